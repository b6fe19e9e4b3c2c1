"""The GPU recipes against their targets' real architectures: `config.json` of each target, written by hand
from the public model configs (tests/fixtures/configs/), builds the recipe's head on the meta device with
the parameter count the architecture implies, and the recipe's memory estimate fits an 80 GB H100 with
room to spare. Nothing is downloaded and no weights exist."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mtp_train.config import RECIPES_DIR, ConfigError, compose, default_overrides
from mtp_train.model.target import TargetArch
from mtp_train.train.distributed import resolve_strategy
from mtp_train.train.memory import GIB, H100_80GB, estimate_memory, load_target_config, meta_head

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "configs"
GPU_RECIPES = ["llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "deepseek-v2-lite"]
NODE = 8  # one node of 8 x H100 80 GB


def expected_parameters(c: dict) -> int:
    """The head's parameters from the architecture, counted by hand: eh_proj (2H x H), one decoder layer,
    five RMSNorms (enorm, hnorm, the layer's two, post_norm)."""
    H, I, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    if c["model_type"] == "deepseek_v2":  # MLA without a query low-rank (V2-Lite): q, compressed kv, expansion
        nope, rope, v, rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        attention = H * heads * (nope + rope) + H * (rank + rope) + rank + rank * heads * (nope + v) + heads * v * H
    else:
        d = c.get("head_dim") or H // heads
        attention = 2 * H * heads * d + 2 * H * c["num_key_value_heads"] * d
    return 2 * H * H + attention + 3 * H * I + 5 * H


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_head_and_memory_on_8_h100(name, capsys):
    fixture = FIXTURES / name
    cfg = compose(name, [f"target.path={fixture}", "run_dir=runs/x"])
    config = load_target_config(cfg.target.path)
    arch = TargetArch.from_pretrained(fixture)
    head = meta_head(config, cfg.head)
    assert all(p.device.type == "meta" for p in head.parameters())
    n = sum(p.numel() for p in head.parameters())
    assert n == expected_parameters(config.to_dict() | arch.as_dict())
    strategy = resolve_strategy(cfg.train.strategy, NODE, torch.device("cuda"))
    assert strategy == "deepspeed" and cfg.train.precision == "bf16" and cfg.target.dtype == "bfloat16"
    est = estimate_memory(config, cfg.train, cfg.data.max_length, NODE, strategy, cfg.head)
    with capsys.disabled():
        print(f"\n{name}: " + est.format(H100_80GB, f"ZeRO-{cfg.train.zero_stage} x {NODE}"))
    assert est.trainable_params == n
    assert est.total < 0.85 * H100_80GB, f"{name}: {est.total / GIB:.1f} GiB leaves too little headroom"
    assert est.activations > est.weights  # the micro-batch, not the head, is what fills these GPUs
    text = (RECIPES_DIR / f"{name}.yaml").read_text().splitlines()
    assert text[1].startswith(f"# Train on one 8xH100 node: launch/train_single_node.sh recipe={name} ")
    assert cfg.train.wandb_project


def test_the_70b_head_is_about_a_billion_parameters():
    config = load_target_config(FIXTURES / "llama3.1-70b")
    n = sum(p.numel() for p in meta_head(config).parameters())
    assert 0.98e9 < n < 1.0e9  # 989,896,704: eh_proj 134 M, attention 151 M, MLP 705 M
    frozen = 2 * config.vocab_size * config.hidden_size * 2  # E and W in bf16
    assert 4.1e9 < frozen < 4.3e9


def test_fixtures_carry_the_architecture_fields():
    for name in GPU_RECIPES:
        arch = TargetArch.from_pretrained(FIXTURES / name)
        assert arch.vocab_size in (128256, 102400) and arch.rope_parameters
    ds = TargetArch.from_pretrained(FIXTURES / "deepseek-v2-lite")
    assert ds.mla == {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                      "q_lora_rank": 0}


def test_zero3_and_checkpointing_lower_the_70b_estimate():
    config = load_target_config(FIXTURES / "llama3.1-70b")
    base = compose("llama3.1-70b", [f"target.path={FIXTURES / 'llama3.1-70b'}", "run_dir=runs/x"])
    tc = base.train
    est = {(stage, ac): estimate_memory(config, dataclasses.replace(tc, zero_stage=stage, activation_checkpointing=ac),
                                        base.data.max_length, NODE, "deepspeed")
           for stage in (1, 2, 3) for ac in (False, True)}
    assert est[(1, False)].gradients > est[(2, False)].gradients == est[(3, False)].gradients
    assert est[(3, False)].weights < est[(2, False)].weights
    assert est[(2, True)].activations < est[(2, False)].activations


def test_the_weight_average_is_counted_on_every_rank():
    """train.ema_decay > 0: one fp32 copy of the whole head (4 bytes a trainable parameter) per rank, at every ZeRO
    stage it is allowed with; nothing else changes."""
    config = load_target_config(FIXTURES / "llama3.1-8b")
    base = compose("llama3.1-8b", [f"target.path={FIXTURES / 'llama3.1-8b'}", "run_dir=runs/x"])
    for stage in (1, 2):
        tc = dataclasses.replace(base.train, zero_stage=stage)
        plain = estimate_memory(config, tc, base.data.max_length, NODE, "deepspeed", base.head)
        averaged = estimate_memory(config, dataclasses.replace(tc, ema_decay=0.99), base.data.max_length, NODE,
                                   "deepspeed", base.head)
        assert averaged.optimizer - plain.optimizer == 4 * plain.trainable_params
        assert (averaged.weights, averaged.activations) == (plain.weights, plain.activations)


def test_online_training_counts_the_target_it_holds():
    """train.features=online: each GPU also holds the bf16 target (Llama-3.1-8B less its lm_head: 7.50 B parameters, 14.0 GiB) and
    one forward of store.batch_tokens; the 8B recipe still fits an H100 with it."""
    from mtp_train.train.memory import online_bytes

    fixture = FIXTURES / "llama3.1-8b"
    cfg = compose("llama3.1-8b", [f"target.path={fixture}", "run_dir=runs/x", "train.features=online"])
    target = online_bytes(cfg)
    weights = 7_504_924_672 * 2  # Llama-3.1-8B without its lm_head (8.03 B with it): 7.50 B parameters in bf16
    assert weights < target < weights + 2 * GIB
    assert online_bytes(compose("llama3.1-8b", [f"target.path={fixture}", "run_dir=runs/x"])) == 0
    config = load_target_config(fixture)
    est = estimate_memory(config, cfg.train, cfg.data.max_length, NODE, "deepspeed", cfg.head, online_target=target)
    offline = estimate_memory(config, cfg.train, cfg.data.max_length, NODE, "deepspeed", cfg.head)
    assert est.target == target and est.total > offline.total + target
    assert "target (online)" in est.format() and "target (online)" not in offline.format()
    assert est.total < 0.85 * H100_80GB


def test_smollm2_recipe_trains_an_eagle3_head_that_starts_from_its_target():
    """`smollm2-135m` trains eagle3 (benchmarks/RESULTS.md, "which head `smollm2-135m` trains"): fc starts as the
    identity on one of the layers it fuses and the layer as the target's next one, on the distribution alone. The
    fixture is the config.json data_prep/fetch_smollm2.py writes. The benchmarks' reset (`PLAIN_HEAD`) makes the
    same recipe train the other variants."""
    from mtp_train.config import PLAIN_HEAD
    from mtp_train.model.head import aux_layer_ids, target_layer_keys

    fixture = FIXTURES / "smollm2-135m"
    cfg = compose("smollm2-135m", [f"target.path={fixture}", "run_dir=runs/x"])
    config = load_target_config(fixture)
    assert cfg.head.variant == "eagle3" and cfg.train.loss.w_feat == 0 and cfg.train.depth == 3
    aux = aux_layer_ids(config, cfg.head)
    assert aux == [2, 15, 27] and cfg.head.init_fc == aux[-1] and cfg.head.init_layer == aux[-1] + 1
    head = meta_head(config, cfg.head)
    head.init_fc_identity(cfg.head.init_fc)  # refuses a layer it does not fuse
    keys = target_layer_keys(head, cfg.head.init_layer, config.num_hidden_layers)
    assert keys["midlayer.self_attn.q_proj.weight"] == "model.layers.28.self_attn.q_proj.weight"
    for variant in ("mtp", "eagle1"):
        plain = compose("smollm2-135m", [f"target.path={fixture}", "run_dir=runs/x", *PLAIN_HEAD,
                                         f"head.variant={variant}"])
        assert plain.head.init_fc == plain.head.init_layer == -1 and not plain.head.norm_output
        assert plain.train.loss.accept_weight == 0 and plain.train.loss.w_feat > 0
    # default_overrides reads the schema: a list comes back as one shell word, a key it lacks is refused by name
    cfg = compose("smollm2-135m", [f"target.path={fixture}", "run_dir=runs/x", "train.betas=[0.8,0.9]",
                                   *default_overrides("train.betas", "head.init_fc")])
    assert cfg.train.betas == [0.9, 0.95] and cfg.head.init_fc == -1
    assert default_overrides("head.aux_layers") == ["head.aux_layers=[]"]
    with pytest.raises(ConfigError, match="head.fc_init: not a key of the run config"):
        default_overrides("head.fc_init")
    with pytest.raises(ValueError, match=r"head.norm_output=true, head.init_fc=27: for head.variant=eagle3 only \(this "
                                         r"head is mtp\); add head.norm_output=false head.init_fc=-1"):
        compose("smollm2-135m", [f"target.path={fixture}", "run_dir=runs/x", "head.variant=mtp"])
