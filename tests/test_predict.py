"""The speed model (mtp_train/inference/predict.py): sizes counted from the modules, the forward-time formula
on made-up profiles against hand-computed numbers, and the speed-up it derives."""

import math
from pathlib import Path

import pytest
from transformers import AutoConfig

from mtp_train.inference import predict as P
from mtp_train.model.head import HeadConfig


def config(name):
    return AutoConfig.from_pretrained(Path(__file__).parent / "fixtures" / "configs" / name)


def test_sizes_of_a_llama_3_1_8b_target_and_its_heads():
    cfg = config("llama3.1-8b")
    t = P.target_cost(cfg)
    H, I, L = 4096, 14336, 32
    assert t.layers == L and t.experts == 0 and t.output_rows == 128256 and t.hidden == H
    assert t.dense_params == L * (H * H + 2 * 1024 * H + H * H + 3 * H * I)  # q, k, v (8 kv heads x 128), o, MLP
    assert t.kv_width == 2 * 8 * 128 and t.attn_width == 32 * 128
    assert t.params_touched(1) == t.dense_params + 128256 * H  # embeddings are looked up, not read whole
    mtp = P.head_cost(cfg, HeadConfig())
    assert mtp.layers == 1 and mtp.output_rows == 128256
    assert mtp.dense_params == 2 * H * H + t.dense_params // L  # eh_proj + one layer
    assert P.head_cost(cfg, HeadConfig(draft_vocab=32000)).output_rows == 32000
    e3 = P.head_cost(cfg, HeadConfig(variant="eagle3", draft_vocab=32000))
    # fc 3H -> H, q/k/v read 2H, its own lm_head over the draft vocabulary as the output rows
    assert e3.output_rows == 32000
    assert e3.dense_params == 3 * H * H + 2 * H * (H + 2 * 1024) + H * H + 3 * H * I


def test_sizes_of_a_mixture_of_experts_target():
    t = P.target_cost(config("deepseek-v2-lite"))
    assert (t.layers, t.experts, t.experts_per_token) == (27, 64, 6)
    assert t.expert_params == 26 * 64 * 3 * 2048 * 1408  # layer 0 is dense (first_k_dense_replace = 1)
    # one token reaches 6 of 64 experts; many tokens reach nearly all of them
    one = t.dense_params + t.expert_params * 6 / 64 + 102400 * 2048
    assert t.params_touched(1) == pytest.approx(one)
    assert t.params_touched(4096) == pytest.approx(t.dense_params + t.expert_params + 102400 * 2048, rel=1e-6)
    assert t.params_per_token() == pytest.approx(one)


DEVICE = P.DeviceProfile("made-up", bandwidth_gb_s=1000, tflops=100, fixed_ms=0.5, per_layer_ms=0.1, tile=64)
COST = P.ModelCost(layers=10, dense_params=1_000_000_000, expert_params=0, experts=0, experts_per_token=0,
                   output_rows=100_000, hidden=1000, kv_width=500, attn_width=1000)


def test_forward_time_by_hand_when_memory_binds():
    # b = 2, n = 3, c = 97: weights 1.1e9 x 2 B, KV 2 x 10 x 100 x 500 x 2 B; flops 2 x 64 x 1.1e9 + attention
    ms = P.forward_ms(COST, DEVICE, batch=2, new=3, context=97, bytes_per_param=2)
    memory = (1.1e9 * 2 + 2 * 10 * 100 * 500 * 2) / 1e12
    flops = (2 * 64 * 1.1e9 + 4 * 6 * 100 * 10 * 1000) / 1e14
    assert memory > flops
    assert ms == pytest.approx(memory * 1e3 + 0.5 + 10 * 0.1)  # 2.2002 ms + 1.5 ms


def test_forward_time_by_hand_when_compute_binds_with_tile_padding():
    # b = 64, n = 9: 576 tokens -> 576 rows (9 tiles); b = 64, n = 8 is 512 rows: the ninth token costs a tile
    nine = P.forward_ms(COST, DEVICE, batch=64, new=9, context=0, bytes_per_param=2)
    flops = (2 * 576 * 1.1e9 + 4 * 576 * 9 * 10 * 1000) / 1e14
    assert nine == pytest.approx(flops * 1e3 + 1.5)
    # at batch 1 every n up to 64 is one tile, and memory binds: verifying 8 tokens costs what 1 does, but KV
    one, eight = (P.forward_ms(COST, DEVICE, 1, n, 0, 2) for n in (1, 8))
    assert eight - one == pytest.approx(7 * 10 * 500 * 2 / 1e12 * 1e3)


def test_speedup_formula_by_hand():
    head = P.ModelCost(1, 50_000_000, 0, 0, 0, 100_000, 1000, 500, 1000)
    r = P.predict_speedup(COST, head, DEVICE, batch=1, k=3, tau=2.5, context=100, bytes_per_param=2)
    T1 = P.forward_ms(COST, DEVICE, 1, 1, 100, 2)
    T4 = P.forward_ms(COST, DEVICE, 1, 4, 100, 2)
    H3, H1 = P.forward_ms(head, DEVICE, 1, 2, 100, 2), P.forward_ms(head, DEVICE, 1, 1, 100, 2)  # round(2.5) = 2
    assert r["speedup"] == pytest.approx(2.5 * T1 / (T4 + H3 + 2 * H1))
    assert r["speculative_tokens_per_s"] / r["tokens_per_s"] == pytest.approx(r["speedup"])
    table = P.serving_table(COST, head, DEVICE, {1: 1.6, 2: 2.1, 3: 2.5}, 100, 2, batches=(1, 64))
    for row in table:
        assert row["best_k"] == max(row["speedup_by_k"], key=row["speedup_by_k"].get)
        assert row["best_speedup"] == max(row["speedup_by_k"].values())
    # a head that costs nothing and drafts perfectly gains tau at batch 1 when memory binds
    free = P.ModelCost(1, 0, 0, 0, 0, 0, 1000, 0, 0)
    still = P.DeviceProfile("x", 1000, 100, 0.0, 0.0, 64)
    assert P.predict_speedup(COST, free, still, 1, 3, 4.0, 0, 2)["speedup"] == pytest.approx(
        4.0 * P.forward_ms(COST, still, 1, 1, 0, 2) / P.forward_ms(COST, still, 1, 4, 0, 2))


def test_profiles():
    h100 = P.profile("H100-SXM")
    assert h100.bandwidth_gb_s == pytest.approx(3350 * 4242 / 4800)
    assert h100.tflops == pytest.approx(989 * 782 / 989)
    with pytest.raises(ValueError, match="unknown device profile 'B200': expected cpu or one of H100-SXM"):
        P.profile("B200")
    cpu = P.measure_cpu()
    assert cpu.name == "cpu" and cpu.bandwidth_gb_s > 0 and cpu.tflops > 0 and cpu.tile == 1
    assert cpu.fixed_ms >= 0 and cpu.per_layer_ms >= 0 and not math.isnan(cpu.fixed_ms)


def test_tree_speedup_formula_by_hand():
    """A tree (steps, topk, num_draft_tokens): the target over num_draft_tokens, the catch-up over ~tau tokens
    and steps - 1 head forwards over the topk frontier nodes."""
    head = P.ModelCost(1, 50_000_000, 0, 0, 0, 100_000, 1000, 500, 1000)
    r = P.predict_speedup(COST, head, DEVICE, batch=4, k=5, tau=2.6, context=100, bytes_per_param=2, tree=(5, 4, 8))
    T1, T8 = (P.forward_ms(COST, DEVICE, 4, n, 100, 2) for n in (1, 8))
    catch_up, frontier = P.forward_ms(head, DEVICE, 4, 3, 100, 2), P.forward_ms(head, DEVICE, 4, 4, 100, 2)
    assert r["speedup"] == pytest.approx(2.6 * T1 / (T8 + catch_up + 4 * frontier)) and r["tree"] == [5, 4, 8]
    table = P.serving_table(COST, head, DEVICE, {3: 2.2}, 100, 2, batches=(1, 64), trees={(5, 4, 8): 2.6})
    for row in table:
        assert list(row["speedup_by_tree"]) == ["tree 5/4/8"]
        options = {"k=3": row["speedup_by_k"][3], "tree 5/4/8": row["speedup_by_tree"]["tree 5/4/8"]}
        assert row["best"] == max(options, key=options.get) and row["best_speedup"] == max(options.values())
    # at batch 64 compute binds: 8 tokens a row cost 8 tiles of 64 where the chain's 4 cost 4, so the tree loses
    # more against the chain than at batch 1, where the verification is memory-bound
    ratio = [row["speedup_by_tree"]["tree 5/4/8"] / row["speedup_by_k"][3] for row in table]
    assert ratio[1] < ratio[0]


def test_step_overhead_from_a_made_up_timing_table_by_hand():
    """Each timed step's overhead is its time less its modelled forwards; the median per k; a further draft
    costs k = 2's less k = 1's. With a profile whose forwards cost only fixed + per-layer time (bandwidth and
    rate so high the roofline is ~0), the target's forward is 2 + 10 x 0.5 = 7 ms, the head's 2.5 ms."""
    device = P.DeviceProfile("x", 1e12, 1e12, 2.0, 0.5, 1)
    target = P.ModelCost(10, 1000, 0, 0, 0, 10, 10, 10, 10)
    head = P.ModelCost(1, 100, 0, 0, 0, 10, 10, 10, 10)
    assert P.modelled_step_ms(target, head, device, 1, 0, 0, 50, 4) == pytest.approx(7.0)
    assert P.modelled_step_ms(target, head, device, 1, 2, 3, 50, 4) == pytest.approx(7.0 + 2.5 + 2.5)
    timings = {0: [(10.0, 0), (11.0, 0), (10.5, 0)],  # overheads 3.0, 4.0, 3.5 -> 3.5
               1: [(22.0, 2), (21.0, 1), (25.0, 2)],  # modelled 9.5: 12.5, 11.5, 15.5 -> 12.5
               2: [(30.0, 3), (29.0, 1)]}  # modelled 12: 18, 17 -> 17.5
    o = P.overhead_from_timings(timings, target, head, device, 1, 50, 4)
    assert (o.plain_ms, o.step_ms, o.per_draft_ms, o.steps_timed) == pytest.approx((3.5, 12.5, 5.0, 8))
    assert o.measured_ms == pytest.approx((10.5, 22.0, 29.5))  # the steps themselves, median per k
    assert o.spec_ms(3) == pytest.approx(22.5)
    # k = 3, tau 2.2: target alone 7 + 3.5 ms; a step 7 + 2.5 (catch-up over round(2.2) = 2) + 2 x 2.5 + 22.5
    r = P.predict_speedup(target, head, device, 1, 3, 2.2, 50, 4, overhead=o)
    assert (r["target_ms"], r["step_ms"]) == pytest.approx((10.5, 37.0))
    assert r["speedup"] == pytest.approx(2.2 * 10.5 / 37.0)  # 0.6243
    # a tree 3/2/4 pays the overhead of its 3 head steps: 7 + 2.5 + 2 x 2.5 + 22.5
    assert P.predict_speedup(target, head, device, 1, 3, 2.2, 50, 4, (3, 2, 4), o)["step_ms"] == pytest.approx(37.0)
    # without the overhead, the same row is the weights-only model's
    assert P.predict_speedup(target, head, device, 1, 3, 2.2, 50, 4)["speedup"] == pytest.approx(2.2 * 7 / 14.5)
    # k = 3 timed too (a CPU's 4-token verification costing more than the roofline says): its own overhead,
    # measured, replaces the extrapolation; a tree verifying 4 tokens takes the chain k = 3's, plus or minus a
    # further head step per head step more or fewer
    o3 = P.overhead_from_timings({**timings, 3: [(40.0, 2), (44.0, 2)]}, target, head, device, 1, 50, 4)
    # modelled k = 3 step: 7 + 2.5 + 2 x 2.5 = 14.5 -> overheads 25.5, 29.5 -> 27.5
    assert o3.by_k == pytest.approx((3.5, 12.5, 17.5, 27.5)) and o3.measured_ms[3] == pytest.approx(42.0)
    assert o3.spec_ms(3) == pytest.approx(27.5) and o3.spec_ms(2) == pytest.approx(17.5)
    assert o3.spec_ms(5) == pytest.approx(27.5 + 2 * 5.0)  # past k = 3: a further draft each
    assert o3.spec_ms(3, verified=4) == pytest.approx(27.5)  # tree 3/2/4: the chain k = 3's verification
    assert o3.spec_ms(2, verified=4) == pytest.approx(27.5 - 5.0)  # tree 2/3/4: one head step fewer
    assert P.predict_speedup(target, head, device, 1, 3, 2.2, 50, 4, (3, 2, 4), o3)["step_ms"] == pytest.approx(
        7 + 2.5 + 2 * 2.5 + 27.5)
    with pytest.raises(ValueError, match="without gaps"):
        P.overhead_from_timings({**timings, 3: [], 4: [(50.0, 2)]}, target, head, device, 1, 50, 4)
    # a k = 2 cheaper than k = 1 (noise) does not make drafts free of cost below nothing
    timings[2] = [(20.0, 1)]
    assert P.overhead_from_timings(timings, target, head, device, 1, 50, 4).per_draft_ms == 0.0
    with pytest.raises(ValueError, match="k = 0 and k = 1"):
        P.overhead_from_timings({1: timings[1]}, target, head, device, 1, 50, 4)
