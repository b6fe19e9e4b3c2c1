"""`mtp-train export`: every layout read back into the head gives the trained head's logits (exact in fp32),
the stitched directory drafts through stock transformers `generate(use_mtp=True)` with greedy output equal to
plain greedy, key names and config fields are the ones the loaders read (vLLM / SGLang files cited in
mtp_train/export/layouts.py), and the refusals say why."""

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

from mtp_train.cli import EXIT_FAILED, main
from mtp_train.config import compose
from mtp_train.export.run import choose_format
from mtp_train.export.run import run as export
from mtp_train.export.layouts import deepseek_eagle, hf_mtp, nextn, vllm_mtp
from mtp_train.export.write import read_back
from mtp_train.model.frozen import FrozenTarget
from mtp_train.model.head import DraftHead, HeadConfig, additive_mask
from mtp_train.model.target import target_fingerprint
from mtp_train.train import checkpoint as ckpt

LLAMA_LAYER = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
               "mlp.up_proj.weight", "mlp.down_proj.weight",
               *(f"self_attn.{p}_proj.weight" for p in "qkvo")}


DRAFT_STEPS_AT_MOST = 18  # 24 tokens: 23 steps if no draft is kept; the trained head makes 16 (7 kept)


def keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def logits(head: DraftHead, frozen: FrozenTarget, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head's logits for the pairs (h_i, x_{i+1}) at positions i+1, causal, as the drafter runs it."""
    T = ids.shape[1] - 1
    mask = additive_mask(torch.ones(T, T, dtype=torch.bool).tril()[None, None], hidden.dtype)
    with torch.no_grad():
        return frozen.logits(head(frozen.embed(ids[:, 1:]), hidden[:, :-1], torch.arange(1, T + 1)[None], mask))


# -- the tiny trained run: hf-mtp ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_copy(validated_run, tmp_path_factory):
    """The validated run's checkpoints and report in a directory of this module's own."""
    src, _ = validated_run
    run_dir = tmp_path_factory.mktemp("export_run")
    shutil.copytree(src / "checkpoints", run_dir / "checkpoints")
    shutil.copytree(src / "validation", run_dir / "validation")
    return run_dir


@pytest.fixture(scope="module")
def exported(run_copy, tiny_run_config):
    cfg = tiny_run_config(run_copy, "export.dtype=fp32")
    assert [p.name for p in export(cfg)] == ["hf-mtp", "hf-mtp-stitched", "vllm-mtp"]  # format=auto, mtp head
    return cfg


@pytest.fixture(scope="module")
def tiny_target(tiny_dir):
    from mtp_train.model.target import TargetConfig, load_causal_lm

    target = tiny_dir / "target"
    return load_causal_lm(target, TargetConfig(path=str(target), device="cpu")), FrozenTarget.from_pretrained(target)


def test_hf_mtp_keys_and_config_are_transformers_mtp_layout(exported, tiny_dir):
    out = Path(exported.run_dir) / "export" / "hf-mtp"
    n = json.loads((tiny_dir / "target" / "config.json").read_text())["num_hidden_layers"]
    p = f"model.layers.{n}."  # transformers' MtpModel reads layer num_hidden_layers + k
    assert keys(out / "model.safetensors") == {p + k for k in LLAMA_LAYER | {
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "post_norm.weight"}}
    config = json.loads((out / "config.json").read_text())
    assert config["num_mtp_layers"] == 1 and config["num_nextn_predict_layers"] == 1
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == n  # the target's, unchanged
    assert "mtp_layer_types" not in config  # only for targets with layer_types (Qwen2/3 below)
    AutoConfig.from_pretrained(out).get_mtp_config()  # what generate(use_mtp=True) builds the MTP layer from


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_hf_mtp_config_of_targets_whose_class_fills_in_layer_types(model_type):
    """Qwen2/3 configs get `layer_types` from their class even when config.json has none; transformers'
    get_mtp_config then needs `mtp_layer_types`, or generate(use_mtp=True) fails at serve time."""
    from mtp_train.export.layouts import exported_config

    target = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "head_dim": 16}
    config = exported_config(target, hf_mtp(target), "float32")
    assert config["mtp_layer_types"] == ["full_attention"]
    mtp = AutoConfig.for_model(**config).get_mtp_config()
    assert mtp.num_hidden_layers == 1


def test_each_layout_read_back_gives_the_trained_logits(exported, tiny_target):
    """Exact in fp32: the export holds the trained head's numbers under other names, nothing else."""
    from mtp_train.model.checkpoint import read_head

    model, frozen = tiny_target
    trained, meta = read_head(exported)
    ids = torch.tensor([[5, 300, 17, 2048, 99, 7, 1200, 64, 8000, 3]])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
    want = logits(trained, frozen, ids, hidden)
    layouts = {"hf-mtp": hf_mtp(model.config.to_dict()), "hf-mtp-stitched": hf_mtp(model.config.to_dict()),
               "vllm-mtp": vllm_mtp(model.config.to_dict())}
    for name, layout in layouts.items():
        back = read_back(Path(exported.run_dir) / "export" / name, layout, "mtp")
        assert torch.equal(logits(back, frozen, ids, hidden), want), name


def test_stitched_runs_the_head_in_stock_transformers_generate(exported, tiny_dir, tiny_target, monkeypatch):
    from transformers.modeling_layers import MtpModel

    out = Path(exported.run_dir) / "export" / "hf-mtp-stitched"
    target = tiny_dir / "target"
    link = out / "target-model.safetensors"
    assert link.is_symlink() and link.resolve() == (target / "model.safetensors").resolve()  # linked, not copied
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {"target-model.safetensors", "model-mtp.safetensors"}
    assert {k for k, f in index.items() if f == "model-mtp.safetensors"} == keys(out / "model-mtp.safetensors")

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model._keys_to_ignore_on_load_unexpected = [r"model\.layers\.4\..*"]  # the documented one-line registration
    drafted, loaded = [], []
    forward, load = MtpModel.forward, MtpModel.from_pretrained.__func__

    def spy_forward(self, *args, **kwargs):
        result = forward(self, *args, **kwargs)
        drafted.append(result[0])
        return result

    def spy_load(cls, *args, **kwargs):
        loaded.append(load(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(MtpModel, "forward", spy_forward)
    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(spy_load))
    from mtp_train.inference.load import encode_prompt
    from mtp_train.model.target import load_tokenizer

    prompt = "Write `def is_palindrome(text)`.\n\nReturn True if text reads the same backwards."
    ids = torch.tensor([encode_prompt(load_tokenizer(target), prompt, chat=True)])
    plain = model.generate(ids, do_sample=False, max_new_tokens=24)
    mtp = model.generate(ids, do_sample=False, max_new_tokens=24, use_mtp=True)
    assert torch.equal(mtp, plain)  # greedy verification: the target's own output
    # one draft per step after the first: 23 steps for 24 tokens if no draft were kept (a random head)
    assert 2 <= len(drafted) <= DRAFT_STEPS_AT_MOST, len(drafted)

    # transformers' MtpLayer, loaded from the stitched directory, computes exactly what DraftHead does
    from mtp_train.model.checkpoint import read_head

    mtp_layer, rotary = loaded[0].layers[0], loaded[0].rotary_emb
    trained, _ = read_head(exported)
    _, frozen = tiny_target
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
    T = ids.shape[1] - 1
    pos = torch.arange(1, T + 1)[None]
    mask = additive_mask(torch.ones(T, T, dtype=torch.bool).tril()[None, None], torch.float32)
    embeds = frozen.embed(ids[:, 1:])
    with torch.no_grad():
        theirs = mtp_layer(embeds, hidden[:, :-1], rotary(embeds, pos), mask, pos, None)
        ours = trained(embeds, hidden[:, :-1], pos, mask)
    assert torch.equal(theirs, ours)


def test_model_card_and_rerun(exported, tiny_dir, capsys):
    run_dir = Path(exported.run_dir)
    report = json.loads((run_dir / "validation" / "report.json").read_text())
    config_sha = __import__("hashlib").sha256((tiny_dir / "target" / "config.json").read_bytes()).hexdigest()
    for name in ("hf-mtp", "hf-mtp-stitched"):
        card = (run_dir / "export" / name / "README.md").read_text()
        assert str((tiny_dir / "target").resolve()) in card and config_sha in card
        assert "mtp-train export recipe=tiny" in card and "Recipe `tiny`" in card
        assert f"val_loss {report['val_loss']:.4f}" in card  # the validation figures, as the table prints them
        assert "No data manifest" in card  # the fixture run has no manifest.json; the card says so
    assert "hf-mtp-stitched" in (run_dir / "export" / "hf-mtp" / "README.md").read_text()  # where to serve it from
    assert "use_mtp=True" in card and r'_keys_to_ignore_on_load_unexpected = [r"model\.layers\.4\..*"]' in card
    before = {p: p.stat().st_mtime_ns for p in (run_dir / "export").rglob("*")}
    assert main(["export", "recipe=tiny", f"run_dir={run_dir}", "dtype=fp32", "target.device=cpu"]) == 0
    assert capsys.readouterr().out.count("is up to date") == 3
    assert {p: p.stat().st_mtime_ns for p in (run_dir / "export").rglob("*")} == before
    # a new validation report (validate reruns in `make demo`) updates the cards, not the weights
    report_file = run_dir / "validation" / "report.json"
    report_file.write_text(json.dumps({**report, "val_loss": 1.2345}))
    assert main(["export", "recipe=tiny", f"run_dir={run_dir}", "dtype=fp32"]) == 0
    assert capsys.readouterr().out.count("its model card is updated") == 3
    assert "val_loss 1.2345" in (run_dir / "export" / "hf-mtp" / "README.md").read_text()
    weights = run_dir / "export" / "hf-mtp" / "model.safetensors"
    assert weights.stat().st_mtime_ns == before[weights]


def test_a_different_export_is_refused_then_replaced_with_overwrite(exported, capsys):
    run_dir = Path(exported.run_dir)
    weights = run_dir / "export" / "hf-mtp" / "model.safetensors"
    before = weights.read_bytes()
    assert main(["export", "recipe=tiny", f"run_dir={run_dir}", "dtype=bf16"]) == EXIT_FAILED
    assert "pass overwrite=true" in capsys.readouterr().err
    assert weights.read_bytes() == before and not list((run_dir / "export").glob(".*"))
    assert main(["export", "recipe=tiny", f"run_dir={run_dir}", "dtype=bf16", "overwrite=true"]) == 0
    with safe_open(str(weights), framework="pt") as f:
        assert f.get_tensor("model.layers.4.eh_proj.weight").dtype == torch.bfloat16
    assert json.loads(weights.with_name("config.json").read_text())["dtype"] == "bfloat16"
    assert main(["export", "recipe=tiny", f"run_dir={run_dir}", "dtype=fp32", "overwrite=true"]) == 0  # restore


def test_mtp_head_is_refused_in_the_eagle_and_nextn_layouts(exported, capsys):
    run_dir = Path(exported.run_dir)
    assert main(["export", "recipe=tiny", f"run_dir={run_dir}", "format=eagle"]) == EXIT_FAILED
    assert "its maths differ" in capsys.readouterr().err
    assert main(["export", "recipe=tiny", f"run_dir={run_dir}", "format=deepseek-nextn"]) == EXIT_FAILED
    assert "this target is 'llama': use format=hf-mtp" in capsys.readouterr().err
    assert not (run_dir / "export" / "eagle-vllm").exists() and not (run_dir / "export" / "deepseek-nextn").exists()


def test_format_choice_and_refusals():
    assert choose_format("auto", "mtp", "llama") == "hf-mtp"
    assert choose_format("auto", "eagle1", "llama") == "eagle"
    assert choose_format("auto", "mtp", "deepseek_v2") == "deepseek-nextn"
    with pytest.raises(ValueError, match="MoE MLP"):  # transformers builds DeepSeek MTP layers as MoE
        choose_format("hf-mtp", "mtp", "deepseek_v2")
    with pytest.raises(ValueError, match="this head is 'eagle1': use format=eagle"):
        choose_format("hf-mtp", "eagle1", "llama")
    with pytest.raises(ValueError, match="Llama loaders"):
        choose_format("eagle", "eagle1", "qwen2")


def test_export_without_a_checkpoint_says_train_first(tmp_path, capsys):
    assert main(["export", "recipe=tiny", f"run_dir={tmp_path}"]) == EXIT_FAILED
    assert "run mtp-train train first" in capsys.readouterr().err


# -- heads built from config: eagle and DeepSeek NextN ----------------------------------------------------------
def randomized(head: DraftHead, seed: int) -> DraftHead:
    """Norm weights away from 1, biases away from 0: a mapping that drops or swaps them shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name else torch.randn(p.shape, generator=g))
    return head


def saved_run(tmp_path: Path, model, head_cfg: HeadConfig, *overrides):
    """A target directory, a one-checkpoint run for a head on it, and the run config."""
    target, run_dir = tmp_path / "target", tmp_path / "run"
    model.save_pretrained(target)
    head = randomized(DraftHead(model.config, head_cfg), seed=1)
    meta = {"variant": head_cfg.variant, "head": asdict(head_cfg), "target_path": str(target),
            "target_fingerprint": target_fingerprint(target), "step": 7, "depth": 1}
    ckpt.save(ckpt.checkpoint_root(run_dir), 7, head.state_dict(), meta, {}, {}, "train:\n  steps: 7\n")
    cfg = compose("tiny", [f"run_dir={run_dir}", f"target.path={target}", "target.draft_path=null",
                           "export.dtype=fp32", *overrides])
    return cfg, head, FrozenTarget.from_pretrained(target)


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=101))


@pytest.mark.parametrize("fc_bias", [True, False])
def test_eagle_layouts_for_vllm_and_sglang(tmp_path, fc_bias):
    cfg, head, frozen = saved_run(tmp_path, tiny_llama(), HeadConfig(variant="eagle1", fc_bias=fc_bias))
    assert [p.name for p in export(cfg)] == ["eagle-vllm", "eagle-sglang"]
    out = Path(cfg.run_dir) / "export"
    layer = {f"layers.0.{k}" for k in LLAMA_LAYER - {"input_layernorm.weight"}}  # both loaders drop it
    attn_bias = {f"layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}
    # vLLM (llama_eagle.py): fc without bias; a trained bias is folded into q/k/v/o biases (attention_bias)
    vllm_keys = keys(out / "eagle-vllm" / "model.safetensors")
    assert vllm_keys == {"fc.weight"} | layer | (attn_bias if fc_bias else set())
    vllm_config = json.loads((out / "eagle-vllm" / "config.json").read_text())
    assert vllm_config["architectures"] == ["EagleLlamaForCausalLM"] and vllm_config["num_hidden_layers"] == 1
    assert vllm_config.get("attention_bias", False) == fc_bias
    # SGLang (llama_eagle.py): fc always has a bias
    assert keys(out / "eagle-sglang" / "model.safetensors") == {"fc.weight", "fc.bias"} | layer
    sglang_config = json.loads((out / "eagle-sglang" / "config.json").read_text())
    assert sglang_config["architectures"] == ["LlamaForCausalLMEagle"] and sglang_config["num_hidden_layers"] == 1
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in vllm_keys)  # the target's

    ids = torch.tensor([[3, 17, 88, 40, 5, 61, 9]])
    hidden = torch.randn(1, ids.shape[1], 64, generator=torch.Generator().manual_seed(2))
    want = logits(head.eval(), frozen, ids, hidden)
    sglang = read_back(out / "eagle-sglang", _layout(out / "eagle-sglang"), "eagle1")
    assert torch.equal(logits(sglang, frozen, ids, hidden), want)
    vllm = read_back(out / "eagle-vllm", _layout(out / "eagle-vllm"), "eagle1")
    if fc_bias:  # the same function with the bias carried by other tensors: equal up to rounding
        torch.testing.assert_close(logits(vllm, frozen, ids, hidden), want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(logits(vllm, frozen, ids, hidden), want)


def test_a_wrong_mapping_is_caught_before_anything_is_written(tmp_path, monkeypatch):
    """The read-back check can fail: a fold that forgets o_proj's share of the bias is refused."""
    from mtp_train.export import layouts

    fold = layouts.fold_fc_bias

    def forgetful(state):
        out = fold(state)
        out["mtp_block.self_attn.o_proj.bias"] = torch.zeros_like(out["mtp_block.self_attn.o_proj.bias"])
        return out

    monkeypatch.setattr(layouts, "fold_fc_bias", forgetful)
    cfg, _, _ = saved_run(tmp_path, tiny_llama(), HeadConfig(variant="eagle1", fc_bias=True))
    with pytest.raises(ValueError, match="does not reproduce the trained head"):
        export(cfg)
    assert not any((Path(cfg.run_dir) / "export").iterdir())  # the temporary directory is gone too


def _layout(path: Path):
    from mtp_train.export.layouts import eagle

    engine = path.name.split("-")[1]
    config = json.loads((path / "config.json").read_text())
    return eagle(config, engine, attention_bias=config.get("attention_bias", False))


def tiny_deepseek():
    torch.manual_seed(0)
    return DeepseekV2ForCausalLM(DeepseekV2Config(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
        vocab_size=101, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        n_shared_experts=1))


def test_deepseek_nextn_layout(tmp_path):
    model = tiny_deepseek()
    cfg, head, frozen = saved_run(tmp_path, model, HeadConfig(variant="mtp"))
    assert [p.name for p in export(cfg)] == ["deepseek-nextn", "deepseek-eagle"]  # format=auto, DeepSeek target
    out = Path(cfg.run_dir) / "export" / "deepseek-nextn"
    got = keys(out / "model.safetensors")
    n = model.config.num_hidden_layers
    p = f"model.layers.{n}."
    # vLLM deepseek_v2.py get_spec_layer_idx_from_weight_name: every tensor of the MTP layer starts so
    assert all(k.startswith(p) for k in got)
    # vLLM deepseek_mtp.py _rewrite_spec_layer_name: these are the layer's own, the rest is its mtp_block
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
           "embed_tokens.weight"}
    assert {p + k for k in own} <= got
    block = {k[len(p):] for k in got} - own
    assert {f"mtp_block.{k}" for k in block} == {k for k in head.state_dict() if k.startswith("mtp_block.")}
    assert "self_attn.kv_a_proj_with_mqa.weight" in block and "mlp.gate_proj.weight" in block
    assert not any("experts" in k for k in block)  # the head's MLP is dense
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor(p + "shared_head.head.weight"), model.lm_head.weight.detach())
        assert torch.equal(f.get_tensor(p + "embed_tokens.weight"), model.model.embed_tokens.weight.detach())
        assert torch.equal(f.get_tensor(p + "shared_head.norm.weight"), head.post_norm.weight.detach())
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["architectures"] == ["DeepSeekMTPModel"]
    assert config["first_k_dense_replace"] == n + 1  # vLLM's DeepseekV2DecoderLayer at index n: dense MLP
    assert "SGLang" in (out / "README.md").read_text()

    ids = torch.tensor([[3, 17, 88, 40, 5, 61, 9]])
    hidden = torch.randn(1, ids.shape[1], 64, generator=torch.Generator().manual_seed(2))
    back = read_back(out, nextn(model.config.to_dict()), "mtp")
    assert torch.equal(logits(back, frozen, ids, hidden), logits(head.eval(), frozen, ids, hidden))

    # beside it, vLLM's EagleDeepSeekMTPModel (deepseek_eagle.py): enorm, hnorm, fc, norm and the layer under
    # layers.0 (its module list's index; vLLM prefixes "model."), no embedding or lm_head
    out = Path(cfg.run_dir) / "export" / "deepseek-eagle"
    got = keys(out / "model.safetensors")
    assert {"enorm.weight", "hnorm.weight", "fc.weight", "norm.weight"} <= got
    layer = {k for k in got if k.startswith("layers.0.")}
    assert got - layer == {"enorm.weight", "hnorm.weight", "fc.weight", "norm.weight"}
    assert {k.replace("layers.0.", "mtp_block.", 1) for k in layer} == {
        k for k in head.state_dict() if k.startswith("mtp_block.")}
    assert not any("experts" in k for k in got)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("fc.weight"), head.eh_proj.weight.detach())
        assert torch.equal(f.get_tensor("norm.weight"), head.post_norm.weight.detach())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleDeepSeekMTPModel"] and config["num_hidden_layers"] == 1
    assert config["first_k_dense_replace"] == n + 1  # vLLM's DeepseekV2DecoderLayer at index n: dense MLP
    assert '"method": "eagle"' in (out / "README.md").read_text()
    back = read_back(out, deepseek_eagle(model.config.to_dict()), "mtp")
    assert torch.equal(logits(back, frozen, ids, hidden), logits(head.eval(), frozen, ids, hidden))


def test_eagle_head_is_refused_in_the_mtp_layouts(tmp_path, capsys):
    cfg, _, _ = saved_run(tmp_path, tiny_llama(), HeadConfig(variant="eagle1"), "export.format=hf-mtp")
    with pytest.raises(ValueError, match="for mtp heads"):
        export(cfg)
    assert not (Path(cfg.run_dir) / "export").exists()


def test_stitching_never_writes_into_the_target(run_copy, tiny_dir, tiny_run_config, tmp_path):
    """A target with a model card of its own (every hub model has one), read-only: the stitched directory
    links it as target-README.md and writes its own card beside it; the target is unchanged. The stitched
    config keeps the target's dtype (what `dtype="auto"` loads the whole model in), whatever the head's."""
    target = shutil.copytree(tiny_dir / "target", tmp_path / "target")
    (target / "README.md").write_text("TARGET CARD\n")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    run_dir = tmp_path / "run"
    shutil.copytree(run_copy / "checkpoints", run_dir / "checkpoints")
    target.chmod(0o555)
    try:
        export(tiny_run_config(run_dir, f"target.path={target}", "export.dtype=fp32"))
    finally:
        target.chmod(0o755)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    out = run_dir / "export" / "hf-mtp-stitched"
    assert (out / "target-README.md").is_symlink() and not (out / "README.md").is_symlink()
    assert "mtp-train export" in (out / "README.md").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == json.loads((target / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((run_dir / "export" / "hf-mtp" / "config.json").read_text())["dtype"] == "float32"


def test_card_leaves_out_a_report_of_another_checkpoint(run_copy, tiny_run_config, tmp_path):
    run_dir = shutil.copytree(run_copy, tmp_path / "run")
    report = json.loads((run_dir / "validation" / "report.json").read_text())
    report["head"]["sha256"] = "0" * 64  # measured other weights
    (run_dir / "validation" / "report.json").write_text(json.dumps(report))
    export(tiny_run_config(run_dir, "export.dtype=fp32"))  # the same weights: only the cards change
    card = (run_dir / "export" / "hf-mtp" / "README.md").read_text()
    assert "not this checkpoint; its figures are left out" in card and "val_loss" not in card


def test_bad_checkpoint_and_another_targets_checkpoint_are_refused(run_copy, tiny_dir, tmp_path, capsys):
    assert main(["export", "recipe=tiny", f"run_dir={run_copy}", f"checkpoint={tmp_path}"]) == EXIT_FAILED
    assert f"{tmp_path} is not a checkpoint" in capsys.readouterr().err
    other = shutil.copytree(tiny_dir / "target", tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    assert main(["export", "recipe=tiny", f"run_dir={run_copy}", f"target.path={other}"]) == EXIT_FAILED
    assert "was trained for target" in capsys.readouterr().err


# -- vllm-mtp: our vLLM plugin's layout (serving/vllm_plugin) ---------------------------------------------------
def test_vllm_mtp_keys_config_and_card(exported):
    """The head under its own names (what the plugin's load_weights reads), the architecture vLLM's EAGLE config
    keeps, one layer; the card gives the plugin's install line and the vllm serve command."""
    from mtp_train.export.card import plugin_dir

    out = Path(exported.run_dir) / "export" / "vllm-mtp"
    assert keys(out / "model.safetensors") == {f"mtp_block.{k}" for k in LLAMA_LAYER} | {
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "post_norm.weight"}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleMtpHeadForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["model_type"] == "llama" and "draft_vocab_size" not in config and config["dtype"] == "float32"
    assert (plugin_dir() / "pyproject.toml").is_file()  # the card's install line names a real package
    plugin = (plugin_dir() / "mtp_train_vllm" / "__init__.py").read_text()
    assert 'ARCHITECTURE = "EagleMtpHeadForCausalLM"' in plugin  # the name the plugin registers
    card = (out / "README.md").read_text()
    assert f"pip install {plugin_dir()}" in card
    assert (f"""--speculative-config '{{"method": "eagle", "model": "{out.resolve()}", "num_speculative_tokens": 3}}'"""
            in card)
    assert "## Draft vocabulary" not in card
    assert "`vllm-mtp` beside this directory" in (out.parent / "hf-mtp" / "README.md").read_text()


def test_vllm_mtp_carries_the_draft_vocabulary(tmp_path):
    """d2t (int64 offsets) in the weights, draft_vocab_size in config.json; read back, the same draft ids; a
    config that disagrees with the weights is refused."""
    cfg, head, frozen = saved_run(tmp_path, tiny_llama(), HeadConfig(variant="mtp", draft_vocab=20),
                                  "export.format=vllm-mtp")
    ids = torch.tensor([0, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 100])
    head.set_draft_vocab(ids)
    state = head.state_dict()
    ckpt.save(ckpt.checkpoint_root(Path(cfg.run_dir)), 8, state, {**json.loads(
        (ckpt.latest(Path(cfg.run_dir) / "checkpoints") / "head.json").read_text()), "step": 8}, {}, {},
        "train:\n  steps: 8\n")
    assert [p.name for p in export(cfg)] == ["vllm-mtp"]
    out = Path(cfg.run_dir) / "export" / "vllm-mtp"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        d2t = f.get_tensor("d2t")
        assert "t2d" not in f.keys()
    assert d2t.dtype == torch.int64 and torch.equal(d2t + torch.arange(20), ids)  # vLLM: target = draft + d2t
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 20
    back = read_back(out, vllm_mtp(config, 20), "mtp")
    assert torch.equal(back.draft_ids, ids)
    card = (out / "README.md").read_text()
    assert "the plugin sets the logits outside it to -inf" in card and "## Draft vocabulary" not in card
    (out / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 19}))
    with pytest.raises(ValueError, match="draft_vocab_size is 19 but the weights hold a d2t of 20"):
        read_back(out, vllm_mtp(config, 20), "mtp")


def test_a_wrong_draft_vocabulary_mapping_is_caught(tmp_path, monkeypatch):
    """The read-back check compares draft ids: a layout that wrote d2t as target ids (not offsets) is refused."""
    from mtp_train.export import layouts

    layout = layouts.vllm_mtp

    def absolute_ids(target_config, draft_vocab=0):
        made = layout(target_config, draft_vocab)
        to_export = made.to_export

        class Wrong(type(made)):
            def to_export(self, state):
                out = to_export(state)
                out["d2t"] = out["d2t"] + torch.arange(out["d2t"].numel())
                return out
        return Wrong(made.name, made.renames, made.target_tensors, made.config)

    monkeypatch.setattr(layouts, "vllm_mtp", absolute_ids)
    cfg, head, _ = saved_run(tmp_path, tiny_llama(), HeadConfig(variant="mtp", draft_vocab=20), "export.format=vllm-mtp")
    head.set_draft_vocab(torch.arange(0, 40, 2))
    meta = json.loads((ckpt.latest(Path(cfg.run_dir) / "checkpoints") / "head.json").read_text())
    ckpt.save(ckpt.checkpoint_root(Path(cfg.run_dir)), 8, head.state_dict(), {**meta, "step": 8}, {}, {}, "x: 1\n")
    with pytest.raises(ValueError, match="maps draft ids to other target ids"):
        export(cfg)
    assert not (Path(cfg.run_dir) / "export" / "vllm-mtp").exists()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_vllm_mtp_for_qwen_targets(tmp_path, family):
    """Qwen2 (q/k/v biases) and Qwen3 (q_norm, k_norm) heads: the layer's own tensors under mtp_block., read back
    exact; one full-attention layer in config.json (the plugin builds Qwen's vLLM layer from it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls, config_cls = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "qwen3": (Qwen3ForCausalLM, Qwen3Config)}[family]
    torch.manual_seed(0)
    model = cls(config_cls(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_hidden_layers=2, vocab_size=101))
    cfg, head, frozen = saved_run(tmp_path, model, HeadConfig(variant="mtp"))
    assert [p.name for p in export(cfg)] == ["hf-mtp", "hf-mtp-stitched", "vllm-mtp"]
    out = Path(cfg.run_dir) / "export" / "vllm-mtp"
    got = keys(out / "model.safetensors")
    assert got == set(head.state_dict())
    extra = {"qwen2": "mtp_block.self_attn.q_proj.bias", "qwen3": "mtp_block.self_attn.q_norm.weight"}[family]
    assert extra in got
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["layer_types"] == ["full_attention"]
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 1
    ids = torch.tensor([[3, 17, 88, 40, 5, 61, 9]])
    hidden = torch.randn(1, ids.shape[1], 64, generator=torch.Generator().manual_seed(2))
    back = read_back(out, vllm_mtp(config), "mtp")
    assert torch.equal(logits(back, frozen, ids, hidden), logits(head.eval(), frozen, ids, hidden))


def test_vllm_mtp_refusals(tmp_path):
    assert choose_format("vllm-mtp", "mtp", "qwen3") == "vllm-mtp"
    with pytest.raises(ValueError, match="this target is 'deepseek_v2': use format=deepseek-nextn"):
        choose_format("vllm-mtp", "mtp", "deepseek_v2")
    with pytest.raises(ValueError, match="this head is 'eagle1': use format=eagle"):
        choose_format("vllm-mtp", "eagle1", "llama")
    with pytest.raises(ValueError, match="format=eagle3"):
        choose_format("vllm-mtp", "eagle3", "llama")
    cfg, _, _ = saved_run(tmp_path, tiny_llama(), HeadConfig(variant="eagle1"), "export.format=vllm-mtp")
    with pytest.raises(ValueError, match="for mtp heads"):
        export(cfg)
