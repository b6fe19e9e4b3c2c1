"""The eagle3 head (EAGLE-3): its layout for a Llama-3.1-8B-shaped target, the unrolled training forward against
the step-by-step drafter, the loss and the gradient of its own lm_head against a direct computation, the
settings it refuses, training and an exact resume on a store with the aux layers, and speculative decoding on
the tiny target: the drafter computes what the training forward does, and greedy output is the target's."""

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from mtp_train.config import compose
from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.runner import load_runner
from mtp_train.inference.speculative import generate, SpeculativeDecoder
from mtp_train.model.head import DraftHead, HeadCache, HeadConfig, additive_mask, unrolled
from mtp_train.model.target import TargetConfig
from mtp_train.train import checkpoint as ckpt
from mtp_train.train.loss import distill_ce
from mtp_train.train.trainer import Trainer
from test_head import CONFIGS, H, own_names, stepwise
from windows import code_windows, layer_inputs

AUX = [1, 2, 3]  # of the tiny target's 4 layers (the default 2, L//2, L-3 repeats a layer there)
DRAFT_VOCAB = 1024
T = 48


def test_layout_for_a_llama_3_1_8b_shaped_target():
    """fc 3·4096 -> 4096 without bias; q, k, v read 2·4096; the aux layers default to (2, L//2, L-3); its own
    lm_head over the draft vocabulary; d2t / t2d as buffers."""
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         num_hidden_layers=32, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072)
    with torch.device("meta"):
        head = DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=32000))
    assert head.aux_layers == [2, 16, 29]
    shapes = {n: tuple(p.shape) for n, p in head.named_parameters()}
    a = "midlayer.self_attn."
    assert shapes == {
        "fc.weight": (4096, 3 * 4096),
        f"{a}q_proj.weight": (4096, 8192), f"{a}k_proj.weight": (1024, 8192), f"{a}v_proj.weight": (1024, 8192),
        f"{a}o_proj.weight": (4096, 4096),
        "midlayer.mlp.gate_proj.weight": (14336, 4096), "midlayer.mlp.up_proj.weight": (14336, 4096),
        "midlayer.mlp.down_proj.weight": (4096, 14336),
        "midlayer.input_layernorm.weight": (4096,), "midlayer.hidden_norm.weight": (4096,),
        "midlayer.post_attention_layernorm.weight": (4096,), "norm.weight": (4096,), "lm_head.weight": (32000, 4096)}
    assert sum(p.numel() for p in head.parameters()) == (3 * 4096 * 4096 + 8192 * (4096 + 2 * 1024) + 4096 * 4096
                                                         + 3 * 14336 * 4096 + 4 * 4096 + 32000 * 4096)
    assert {n: tuple(b.shape) for n, b in head.named_buffers() if n in ("d2t", "t2d")} == {"d2t": (32000,),
                                                                                          "t2d": (128256,)}


NORMS = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}


@pytest.mark.parametrize("family, options", [("llama", {}), ("qwen3", {}), ("deepseek_v2", {}), ("llama", NORMS),
                                             ("llama", {"num_layers": 3}), ("llama", {**NORMS, "num_layers": 2})],
                         ids=["llama", "qwen3", "deepseek_v2", "llama-norms", "llama-3-layers", "llama-norms-2-layers"])
def test_unrolled_equals_stepwise_drafter(family, options):
    """The training-time test at depth 3: for every anchor and depth, the unrolled forward's output equals
    what the drafter computes step by step with its KV cache (the chain fed the layer's pre-norm output, or
    with `norm_output` its normalised output; the three norm options together; with `num_layers` > 1 every layer
    keeps its own keys and values)."""
    torch.manual_seed(1)
    head = DraftHead(CONFIGS[family], HeadConfig(variant="eagle3", draft_vocab=50, aux_layers=[0, 1],
                                                 **options)).eval()
    assert head.fc.in_features == 2 * H and head.layer.self_attn.q_proj.in_features == 2 * H
    embed = torch.nn.Embedding(101, H)
    W = torch.randn(50, H)
    aux, ids, lengths = torch.randn(2, 8, 2 * H), torch.randint(0, 101, (2, 8)), torch.tensor([8, 5])
    with torch.no_grad():
        outs = unrolled(head, embed, aux, ids, lengths, 3)
        checked = 0
        for b in range(2):
            for (a, j), h in stepwise(head, embed, aux[b], ids[b], int(lengths[b]), 3).items():
                torch.testing.assert_close(outs[j][b, a] @ W.T, h @ W.T, atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked == (7 + 6 + 5) + (4 + 3 + 2)


def test_more_layers_follow_the_midlayer_as_plain_llama_layers(tiny_dir):
    """head.num_layers=3: layers 1-2 are Llama decoder layers H wide (named as vLLM names them after layer 0),
    each with its own cache layer; the head computes midlayer, then each, then the norm; 0 layers and another
    variant are refused."""
    config = AutoConfig.from_pretrained(tiny_dir / "target")
    torch.manual_seed(2)
    head = DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=64, aux_layers=AUX, num_layers=3)).eval()
    one = DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=64, aux_layers=AUX)).eval()
    names = own_names(head)
    assert names - own_names(one) == {f"layers.{i}.{n}" for i in (1, 2) for n, _ in
                                      head.layers["1"].named_parameters()}
    assert head.layers["2"].self_attn.q_proj.in_features == config.hidden_size
    one.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("layers.")})
    x, e = torch.randn(1, 6, 3 * config.hidden_size), torch.randn(1, 6, config.hidden_size)
    pos = torch.arange(1, 7)[None]
    mask = additive_mask(torch.ones(6, 6, dtype=torch.bool).tril()[None, None], x.dtype)
    cache = HeadCache()
    with torch.no_grad():
        z = one(e, one.fuse(x), pos, mask)  # the midlayer alone, then layers 1 and 2 by hand
        rotary = one.rotary_emb(z, pos)
        for i in ("1", "2"):
            z = head.layers[i](z, attention_mask=mask, position_ids=pos, position_embeddings=rotary)
        torch.testing.assert_close(head(e, head.fuse(x), pos, mask, cache), z)
    assert [k.shape[-2] for k in cache.layer_keys] == [6, 6, 6]
    with pytest.raises(ValueError, match="head.num_layers=0"):
        HeadConfig(variant="eagle3", draft_vocab=64, num_layers=0)
    with pytest.raises(ValueError, match="head.num_layers=2: for head.variant=eagle3 only"):
        HeadConfig(variant="mtp", num_layers=2)


def test_detach_chain_cuts_only_the_chained_state():
    """`train.detach_chain`: the forward is unchanged; the depth-1 loss's gradients are unchanged; a depth-2 loss
    still trains every weight (through the state it is handed and the cache) but no longer reaches the step that
    made that state through it: its gradient on depth 1's output is exactly zero through the chain."""
    torch.manual_seed(2)
    head = DraftHead(CONFIGS["llama"], HeadConfig(variant="eagle3", draft_vocab=50, aux_layers=[0, 1]))
    embed = torch.nn.Embedding(101, H).requires_grad_(False)
    aux, ids, lengths = torch.randn(2, 8, 2 * H), torch.randint(0, 101, (2, 8)), torch.tensor([8, 5])

    def grads(detach: bool, depth_index: int) -> tuple[list[torch.Tensor], dict]:
        head.zero_grad()
        outs = unrolled(head, embed, aux, ids, lengths, 2, detach_chain=detach)
        outs[depth_index].square().sum().backward()
        return [o.detach() for o in outs], {n: p.grad.clone() for n, p in head.named_parameters()
                                          if p.grad is not None}

    outs_full, d1_full = grads(False, 0)
    outs_cut, d1_cut = grads(True, 0)
    for a, b in zip(outs_full, outs_cut):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert d1_full.keys() == d1_cut.keys()
    for n in d1_full:
        torch.testing.assert_close(d1_full[n], d1_cut[n], rtol=0, atol=0)
    _, d2_full = grads(False, 1)
    _, d2_cut = grads(True, 1)
    assert d2_cut.keys() == d2_full.keys() and all(g.abs().sum() > 0 for g in d2_cut.values())
    assert any(not torch.allclose(d2_full[n], d2_cut[n]) for n in d2_full)
    # the state handed from step 0 to step 1, captured: under detach_chain nothing flows back through it
    handed = []
    hook = head.register_forward_hook(lambda m, args, out: handed.append(out) or out.retain_grad())
    try:
        for detach, expect_zero in ((False, False), (True, True)):
            handed.clear()
            head.zero_grad()
            outs = unrolled(head, embed, aux, ids, lengths, 2, detach_chain=detach)
            outs[1].square().sum().backward()
            assert (handed[0].grad is None or bool((handed[0].grad == 0).all())) == expect_zero
    finally:
        hook.remove()


def direct(x, y, W, Wd, ids, weight, temperature):
    t = y @ W.T
    inside = torch.isin(t.argmax(-1), ids)
    p_sub = torch.softmax(t[:, ids] / temperature, -1)
    log_q = torch.log_softmax(x @ Wd.T, -1)
    return -(weight * inside * (p_sub * log_q).sum(-1)).sum()


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_loss_and_its_own_lm_head_gradient_equal_direct(chunk):
    """With its own lm_head Wd, q = softmax(Wd x) and p the target renormalised over the draft vocabulary (from
    W's rows, not Wd's); the chunked loss gives the direct computation's loss and gradients for x and Wd."""
    torch.manual_seed(0)
    N, Hd, V = 53, 16, 97
    W, y, weight = torch.randn(V, Hd), torch.randn(N, Hd), torch.rand(N)
    ids = torch.randperm(V)[:40].sort().values
    x1 = torch.randn(N, Hd, requires_grad=True)
    Wd1 = (W[ids] + 0.3 * torch.randn(40, Hd)).requires_grad_(True)
    x2, Wd2 = x1.detach().clone().requires_grad_(True), Wd1.detach().clone().requires_grad_(True)
    loss, _ = distill_ce(x1, y, W, weight, 0.7, chunk, Wd1, ids, Wt=W[ids])
    ref = direct(x2, y, W, Wd2, ids, weight, 0.7)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    (1.5 * loss).backward()
    (1.5 * ref).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(Wd1.grad, Wd2.grad, rtol=1e-4, atol=1e-6)
    assert Wd1.grad.abs().sum() > 0


def test_settings_it_refuses(tiny_dir):
    config = AutoConfig.from_pretrained(tiny_dir / "target")
    with pytest.raises(ValueError, match="eagle3 trains its own lm_head over a draft vocabulary: set head.draft_vocab"):
        HeadConfig(variant="eagle3")
    with pytest.raises(ValueError, match=r"head.aux_layers=\[1,2\]: for head.variant=eagle3 only"):
        HeadConfig(aux_layers=[1, 2])
    with pytest.raises(ValueError, match=r"the default \(2, L//2, L-3\) = \[2, 2, 1\]: expected ascending, distinct "
                                         r"layer indices in 0..3 for a target of 4 layers; set head.aux_layers"):
        DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=64))
    with pytest.raises(ValueError, match=r"head.aux_layers=\[1, 4\]"):
        DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=64, aux_layers=[1, 4]))
    with pytest.raises(ValueError, match=r"head.norm_before_fc=true: for head.variant=eagle3 only \(this head is mtp\); "
                                         r"add head.norm_before_fc=false$"):
        HeadConfig(norm_before_fc=True)
    with pytest.raises(ValueError, match=r"^head.norm_output=true, head.aux_layers=\[1,2,3\], head.init_fc=2: for "
                                         r"head.variant=eagle3 only \(this head is eagle1\); add head.norm_output=false "
                                         r"head.aux_layers=\[\] head.init_fc=-1$"):  # all of them at once
        HeadConfig(variant="eagle1", norm_output=True, aux_layers=[1, 2, 3], init_fc=2)


def test_norm_before_fc_makes_the_fused_input_scale_free(tiny_dir):
    """`input_norm` over the concatenated features: a token's features scaled by any factor (SmolLM2's massive
    activations differ by orders of magnitude between tokens) fuse to the same g."""
    config = AutoConfig.from_pretrained(tiny_dir / "target")
    torch.manual_seed(0)
    head = DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=64, aux_layers=AUX, norm_before_fc=True))
    x = torch.randn(1, 6, 3 * 256)
    scale = torch.tensor([1.0, 10.0, 1000.0, 0.5, 3.0, 1.0])[None, :, None]
    torch.testing.assert_close(head.fuse(x * scale), head.fuse(x), atol=1e-4, rtol=1e-4)
    plain = DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=64, aux_layers=AUX))
    assert "input_norm.weight" in head.state_dict() and "input_norm.weight" not in plain.state_dict()


@pytest.mark.parametrize("options", [{"norm_before_fc": True}, {"norm_before_residual": True}, {"norm_output": True},
                                     {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}])
def test_the_norm_options_export_for_vllm_only(tiny_dir, tmp_path, options):
    """A head with any norm option: both directories state it (vLLM reads `norm_before_fc` at the top level
    and in `eagle_config`, `input_norm.weight` beside fc), vLLM's reading gives the head's logits exactly at the
    first and the second chained step, SGLang (which has none of the options) is left out of the engines, and a
    config that drops the option is caught."""
    import json

    from safetensors.torch import load_file

    from mtp_train.export import eagle3

    config = AutoConfig.from_pretrained(tiny_dir / "target")
    torch.manual_seed(0)
    head = DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=64, aux_layers=AUX, **options)).eval()
    with torch.no_grad():  # not the init's ones: a reading that skips a norm's weight must differ
        for n, p in head.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    state = head.state_dict()
    made = eagle3.configs(head, config.to_dict(), str(tiny_dir / "target"), "float32")
    for name in (eagle3.EAGLE3, eagle3.EAGLE3_SPECULATORS):
        out = tmp_path / name
        out.mkdir()
        eagle3.write(out, name, state, made[name], torch.float32)
        written = json.loads((out / "config.json").read_text())
        assert eagle3.norms(written) == {"norm_before_residual": False, "norm_before_fc": False, "norm_output": False,
                                         **options}
        assert eagle3.engines(name, written) == ("vllm",)
        assert ("input_norm.weight" in load_file(str(out / "model.safetensors"))) == bool(options.get("norm_before_fc"))
        eagle3.check_engine_round_trip(head, out, name, config)
        for key in options:  # the option left out of config.json: vLLM reads another head
            bad = {k: v for k, v in written.items() if k != key}
            bad["eagle_config"] = {k: v for k, v in (written.get("eagle_config") or {}).items() if k != key} or None
            if name == eagle3.EAGLE3_SPECULATORS and key == "norm_before_residual":
                bad[key] = False  # the speculators path reads an absent norm_before_residual as true
            (out / "config.json").write_text(json.dumps({k: v for k, v in bad.items() if v is not None}))
            with pytest.raises(ValueError, match=rf"the {name} export in {out}"):
                eagle3.check_engine_round_trip(head, out, name, config)
            (out / "config.json").write_text(json.dumps(written))
    # why SGLang is left out: its reading of the native directory (no norm options) drafts from other logits
    g = torch.Generator().manual_seed(0)
    hidden, embeds = list(torch.randn(config.num_hidden_layers + 1, 8, 256, generator=g)), torch.randn(8, 256, generator=g)
    sglang = eagle3.read_engine(tmp_path / eagle3.EAGLE3, "sglang", config)
    assert not torch.allclose(eagle3.engine_logits(sglang.float(), hidden, embeds),
                              eagle3.engine_logits(head, hidden, embeds))


def test_a_head_of_more_layers_exports_for_vllm_only(tiny_dir, tmp_path):
    """head.num_layers=2: both directories write `layers.1.*` and `num_hidden_layers: 2`, vLLM's reading gives the
    head's logits exactly, SGLang (one layer only) is left out and refuses it, and a config that states one layer
    is caught."""
    import json

    from safetensors.torch import load_file

    from mtp_train.export import eagle3

    config = AutoConfig.from_pretrained(tiny_dir / "target")
    torch.manual_seed(0)
    head = DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=64, aux_layers=AUX, num_layers=2)).eval()
    made = eagle3.configs(head, config.to_dict(), str(tiny_dir / "target"), "float32")
    for name, first in ((eagle3.EAGLE3, "midlayer."), (eagle3.EAGLE3_SPECULATORS, "layers.0.")):
        out = tmp_path / name
        out.mkdir()
        eagle3.write(out, name, head.state_dict(), made[name], torch.float32)
        written = json.loads((out / "config.json").read_text())
        assert eagle3.num_layers(written) == 2 and eagle3.engines(name, written) == ("vllm",)
        keys = set(load_file(str(out / "model.safetensors")))
        assert f"{first}self_attn.q_proj.weight" in keys and "layers.1.mlp.down_proj.weight" in keys
        eagle3.check_engine_round_trip(head, out, name, config)
        layer = written.get("transformer_layer_config") or written
        layer["num_hidden_layers"] = 1
        (out / "config.json").write_text(json.dumps(written))
        with pytest.raises(ValueError, match=rf"the {name} export in {out} cannot be read as vllm reads it"):
            eagle3.check_engine_round_trip(head, out, name, config)
    with pytest.raises(ValueError, match="SGLang's EAGLE-3 serves one decoder layer, this head has 2"):
        layer = json.loads((tmp_path / eagle3.EAGLE3 / "config.json").read_text())
        layer["num_hidden_layers"] = 2
        (tmp_path / eagle3.EAGLE3 / "config.json").write_text(json.dumps(layer))
        eagle3.read_engine(tmp_path / eagle3.EAGLE3, "sglang", config)


def test_training_depth_defaults_to_the_variants(tmp_path):
    def depth(recipe, *overrides):
        return compose(recipe, [f"run_dir={tmp_path}", *overrides]).train.depth

    e3 = ("head.variant=eagle3", "head.draft_vocab=64", "head.aux_layers=[1,2,3]")
    assert depth("tiny") == 1 and depth("tiny", "head.variant=eagle1") == 1
    assert depth("tiny", *e3) == 7  # EAGLE-3's training-time test, where the recipe leaves depth unset
    assert depth("tiny", *e3, "train.depth=2") == 2  # a command line or recipe value wins
    assert depth("smollm2-135m", "head.variant=eagle3") == 3  # that recipe sets depth 3
    with pytest.raises(ValueError, match=r"train.depth=0: must be >= 1"):
        compose("tiny", [f"run_dir={tmp_path}", "train.depth=0"])


@pytest.fixture(scope="module")
def samples(tiny_dir):
    """64 windows of stdlib code with the tiny target's final hidden states and the aux layers' inputs."""
    target = tiny_dir / "target"
    ids, hidden = code_windows(target, slice(0, 40), T)
    aux = layer_inputs(target, ids, AUX)
    out = []
    for i in range(len(ids)):
        n = T - (i % 5) * 3
        mask = torch.ones(n, dtype=torch.int8)
        mask[:8] = 0
        out.append({"hidden": hidden[i, :n].clone(), "input_ids": ids[i, :n].clone(), "loss_mask": mask,
                    "layers": aux[i, :, :n].clone()})
    return out


def eagle3(run_dir, *overrides):
    return compose("tiny", [f"run_dir={run_dir}", "head.variant=eagle3", f"head.draft_vocab={DRAFT_VOCAB}",
                            f"head.aux_layers=[{','.join(map(str, AUX))}]", "train.loss.w_feat=0", "train.depth=3",
                            "train.micro_batch=8", "train.warmup_steps=2", "train.eval_every=0", "train.log_every=1",
                            "train.lr=3e-3", *overrides])


def store(run_dir, samples, tiny_dir, layers=True):
    from mtp_train.store.format import identity_for, write_split

    identity = identity_for(tiny_dir / "target")
    keep = (lambda s: s) if layers else (lambda s: {k: v for k, v in s.items() if k != "layers"})
    for split, part in (("train", samples[:48]), ("val", samples[48:])):
        write_split(run_dir / "store" / split, [keep(s) for s in part], identity=identity,
                    layers=AUX if layers else ())
    return run_dir


def test_a_store_without_the_aux_layers_is_refused(tmp_path, samples, tiny_dir):
    store(tmp_path, samples, tiny_dir, layers=False)
    with pytest.raises(ValueError, match=r"holds layers \[\], not \[1, 2, 3\], which the head reads: precompute with "
                                         r"store.layers=\[1, 2, 3\]"):
        Trainer(eagle3(tmp_path, "train.steps=2"))
    with pytest.raises(ValueError, match="an eagle3 head is trained on the distribution alone"):
        Trainer(eagle3(tmp_path, "train.steps=2", "train.loss.w_feat=0.1"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, samples, tiny_dir):
    run_dir = store(tmp_path_factory.mktemp("eagle3"), samples, tiny_dir)
    trainer = Trainer(eagle3(run_dir, "train.steps=40", "train.save_every=20"))
    first = trainer.validate()
    trainer.fit()
    return run_dir, first, trainer.validate()


def test_training_learns_and_the_lm_head_moves(trained, tiny_dir):
    run_dir, before, after = trained
    assert after["d1/acc"] > before["d1/acc"] + 0.1 and after["d1/ce"] < before["d1/ce"]
    head = ckpt.load_head_state(run_dir / "checkpoints" / "step-000040")
    from mtp_train.model.frozen import FrozenTarget

    frozen = FrozenTarget.from_pretrained(tiny_dir / "target")
    ids = head["d2t"] + torch.arange(DRAFT_VOCAB)
    start = frozen.lm_head_weight.index_select(0, ids)
    assert not torch.equal(head["lm_head.weight"], start)  # trained, from W's rows
    assert (head["lm_head.weight"] - start).norm() < 0.5 * start.norm()


def test_resume_is_exact(trained, samples, tiny_dir, tmp_path, monkeypatch):
    """Killed after its step-20 checkpoint and resumed: the same weights at step 40 as the uninterrupted run."""
    run_dir, _, _ = trained
    other = store(tmp_path, samples, tiny_dir)
    real = Trainer.train_step

    def dying(self, micro):
        if self.step == 25:
            raise KeyboardInterrupt
        return real(self, micro)

    monkeypatch.setattr(Trainer, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        Trainer(eagle3(other, "train.steps=40", "train.save_every=20")).fit()
    monkeypatch.setattr(Trainer, "train_step", real)
    Trainer(eagle3(other, "train.steps=40", "train.save_every=20", "resume=true")).fit()
    a = ckpt.load_head_state(run_dir / "checkpoints" / "step-000040")
    b = ckpt.load_head_state(other / "checkpoints" / "step-000040")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runner(tiny_dir):
    return load_runner(str(tiny_dir / "target"), TargetConfig(path=str(tiny_dir / "target"), device="cpu"))


@pytest.fixture(scope="module")
def drafter(trained, runner, tiny_run_config):
    from mtp_train.inference.load import load_head

    run_dir, _, _ = trained
    d = load_head(tiny_run_config(run_dir), runner)[0]  # the head as its checkpoint describes it
    assert d.feature_layers == AUX
    return d


def test_drafter_computes_what_the_training_forward_does(drafter, runner, samples):
    """Draft 1 and 2's q equal the unrolled forward's at the same anchor, fed the aux layers' states that the
    runner catches during decoding (transformers' hidden_states[i], as precompute stores them)."""
    prompt = samples[50]["input_ids"][:20].tolist()
    dec = SpeculativeDecoder(runner, [prompt], drafter=drafter, k=2, max_new_tokens=8)
    proposal = drafter.propose(dec.seqs, dec.features, 2, SamplingConfig(temperature=1.0),
                               torch.Generator().manual_seed(0))
    seq, P = dec.seqs[0], len(prompt)
    d1 = int(proposal.tokens[0, 0])
    with torch.no_grad():
        states = runner.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in AUX], dim=-1)  # [P + 1, 3H]
    torch.testing.assert_close(dec.features.hidden[0], aux[:P], atol=1e-4, rtol=1e-4)  # what the runner caught
    ids = torch.tensor([seq + [d1]])
    h = torch.cat([aux, torch.zeros(1, aux.shape[-1])])[None]
    outs = unrolled(drafter.head, runner.model.get_input_embeddings(), h, ids, torch.tensor([P + 2]), depth=2)
    draft = drafter.head.draft_lm_head(runner.lm_head.weight)
    for j in range(2):
        q = torch.zeros(runner.vocab_size)
        q[draft.ids] = torch.softmax(draft.logits(outs[j][0, P - 1]).float(), -1)
        torch.testing.assert_close(proposal.probs[0, j], q, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_output_is_the_targets(drafter, runner, samples, k):
    prompts = [samples[i]["input_ids"][:n].tolist() for i, n in zip(range(48, 56), (5, 9, 14, 20, 26, 31, 37, 44))]
    reference = [generate(runner, [p], max_new_tokens=24).tokens[0] for p in prompts]
    out = generate(runner, prompts, drafter=drafter, k=k, max_new_tokens=24)
    assert out.tokens == reference
    s = out.stats  # the trained head drafts (not one that is always rejected): measured 21 of 155 kept at k = 1
    assert s.accepted[0] >= 0.1 * s.drafted[0] and s.tau > 1.1


# -- exports -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(trained, tiny_run_config):
    from mtp_train.export.run import run as export

    run_dir, _, _ = trained
    cfg = tiny_run_config(run_dir, "export.dtype=fp32")
    return cfg, export(cfg)


def test_exports_in_both_engines_layouts(exported, tiny_dir):
    """eagle3/: SpecForge's keys, the aux ids in vLLM's (top level) and SGLang's (nested, one less) conventions;
    eagle3-speculators/: layers.0.*, norm_before_residual written as false, the verifier named; d2t offsets."""
    import json

    from safetensors.torch import load_file

    cfg, paths = exported
    assert [p.name for p in paths] == ["eagle3", "eagle3-speculators"]
    native, spec = (json.loads((p / "config.json").read_text()) for p in paths)
    assert native["architectures"] == ["LlamaForCausalLMEagle3"] and native["num_hidden_layers"] == 1
    assert native["eagle_aux_hidden_state_layer_ids"] == AUX
    assert native["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    assert native["draft_vocab_size"] == DRAFT_VOCAB and native["target_hidden_size"] == 256
    assert native["norm_before_residual"] is False and spec["norm_before_residual"] is False
    assert spec["speculators_model_type"] == "eagle3" and spec["eagle_aux_hidden_state_layer_ids"] == AUX
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str((tiny_dir / "target").resolve())
    a, b = (load_file(str(p / "model.safetensors")) for p in paths)
    assert set(a) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{k}" for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                                  "post_attention_layernorm.weight")}
    assert {k.replace("layers.0.", "midlayer.") for k in b} == set(a)
    assert a["d2t"].dtype == torch.int64 and a["t2d"].dtype == torch.bool and int(a["t2d"].sum()) == DRAFT_VOCAB
    ids = a["d2t"] + torch.arange(DRAFT_VOCAB)
    assert bool((ids[1:] > ids[:-1]).all()) and bool(a["t2d"][ids].all())
    card = (paths[0] / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3" in card and '"method": "eagle3"' in card


def test_a_bf16_export_reads_back_exactly(trained, tiny_run_config, tmp_path):
    """In the tiny target's own dtype (bf16): the trained weights rounded once, each engine's reading equal to
    them bit for bit (rotary frequencies included: both sides round the head the same way)."""
    import shutil

    from mtp_train.export.run import run as export

    run_dir, _, _ = trained
    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    paths = export(tiny_run_config(tmp_path))
    from safetensors.torch import load_file

    assert load_file(str(paths[0] / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def _mutated(src, tmp_path, edit_config=None, edit_tensors=None):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / src.name
    shutil.copytree(src, out)
    if edit_config:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


def _shift(config, nested=False):
    if nested:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = AUX  # SGLang then reads AUX + 1
    else:
        config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in AUX]


MISTAKES = {
    "ids shifted for vLLM": ("eagle3", lambda c: _shift(c), None),
    "ids shifted for SGLang": ("eagle3", lambda c: _shift(c, nested=True), None),
    "d2t absolute": ("eagle3", None, lambda t: t.update(d2t=t["d2t"] + torch.arange(DRAFT_VOCAB))),
    "norm_before_residual true": ("eagle3-speculators", lambda c: c.update(norm_before_residual=True), None),
    "norm_before_residual left out": ("eagle3-speculators", lambda c: c.pop("norm_before_residual"), None),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_classic_mistakes_are_caught(exported, tiny_dir, tmp_path, mistake):
    """The exports pass each engine's reading; each classic train/serve mismatch, planted in a copy, fails it."""
    from mtp_train.export.eagle3 import check_engine_round_trip
    from mtp_train.model.checkpoint import read_head

    cfg, paths = exported
    head, _ = read_head(cfg)
    config = AutoConfig.from_pretrained(tiny_dir / "target")
    for p in paths:
        check_engine_round_trip(head, p, p.name, config)
    name, edit_config, edit_tensors = MISTAKES[mistake]
    bad = _mutated(paths[0] if name == "eagle3" else paths[1], tmp_path, edit_config, edit_tensors)
    with pytest.raises(ValueError, match=rf"the {name} export in {bad}"):
        check_engine_round_trip(head, bad, name, config)
