"""The model card (`README.md`) written into every export directory: what the head is, what made it (recipe,
commands, checkpoint, target identity, data counts), how well it drafts (the validation report), and how
to serve this directory with transformers, vLLM and SGLang."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtp_train import __version__
from mtp_train.export.eagle3 import SPECULATIVE_TOKENS
from mtp_train.files import sha256_file
from mtp_train.report import format_table


@dataclass
class CardInputs:
    """Everything a card says, gathered once per export run."""

    recipe: str
    run_dir: str
    command: str  # the export command
    checkpoint: str
    meta: dict  # the checkpoint's head.json
    target_path: str
    target_config: dict
    config_sha256: str  # of the target's config.json
    fingerprint: str  # mtp_train.model.target.target_fingerprint
    dtype: str
    train: dict  # the checkpoint's resolved `train` settings
    manifest: dict | None  # run_dir/data/manifest.json
    report: dict | None  # run_dir/validation/report.json


def _identity(c: CardInputs) -> str:
    t, m = c.target_config, c.meta
    return "\n".join([
        f"- target: `{c.target_path}` ({t.get('model_type')}, {t.get('num_hidden_layers')} layers, hidden "
        f"{t.get('hidden_size')}, vocabulary {t.get('vocab_size')})",
        f"- target `config.json` sha256: `{c.config_sha256}`",
        f"- target fingerprint (config, weight index, weight file names and sizes): `{c.fingerprint}`",
        f"- head: `{m['variant']}` ({', '.join(f'{k}={v}' for k, v in m['head'].items())}), trained at depth "
        f"{m.get('depth')} for {m['step']} steps; checkpoint `{c.checkpoint}`; exported as {c.dtype}",
    ])


def _draft_vocab(layout: str, c: CardInputs) -> str:
    """What a draft vocabulary the head was trained with means for this layout ("" without one)."""
    n = c.meta["head"].get("draft_vocab", 0)
    if not n or layout in ("eagle3", "eagle3-speculators", "vllm-mtp"):  # these layouts carry it (d2t)
        return ""
    coverage = c.meta.get("draft_vocab_coverage")
    covered = f", covering {coverage:.1%} of the trained positions" if coverage is not None else ""
    engine = {"hf-mtp": "transformers' MTP (`generate(use_mtp=True)`) drafts over the full vocabulary through the "
                        "shared lm_head",
              "hf-mtp-stitched": "transformers' MTP (`generate(use_mtp=True)`) drafts over the full vocabulary "
                                 "through the shared lm_head",
              "eagle-vllm": "vLLM's EAGLE-1 draft uses the target's full lm_head",
              "eagle-sglang": "SGLang's EAGLE-1 draft uses the target's full lm_head"}.get(
        layout, "the engine drafts with the target's full lm_head (`shared_head.head`)")
    return f"""## Draft vocabulary

The head was trained with a draft vocabulary of {n:,} of the target's {c.target_config.get('vocab_size'):,} tokens
(`head.draft_vocab={n}`: the most frequent tokens at the training data's trained positions{covered}), drafting
with the target's lm_head rows for them only. This layout has no draft vocabulary, so it is not exported (no
`d2t` / `t2d`): {engine}. The head's distribution over the other tokens was never trained, so drafts may
differ from the ones measured in validation (which drafted over the draft vocabulary) and acceptance may be
lower; greedy output stays the target's own.

"""


def _making(c: CardInputs) -> str:
    keys = ("steps", "micro_batch", "grad_accum", "lr", "depth", "precision", "strategy")
    settings = ", ".join(f"{k}={c.train[k]}" for k in keys if k in c.train)
    return "\n".join([
        "```bash",
        f"mtp-train pipeline recipe={c.recipe} run_dir={c.run_dir}   # + the overrides recorded in config.yaml",
        c.command,
        "```",
        f"Recipe `{c.recipe}`; training settings: {settings}. The checkpoint's resolved run config, overrides "
        f"included, is `{Path(c.checkpoint) / 'config.yaml'}`.",
    ])


def _data(manifest: dict | None) -> str:
    if not manifest:
        return "No data manifest in the run directory (`run_dir/data/manifest.json`)."
    rows = ["| split | samples | tokens | trainable tokens |", "|---|---:|---:|---:|"]
    for name, s in manifest.get("splits", {}).items():
        rows.append(f"| {name} | {s['samples']:,} | {s['tokens']:,} | {s['masked_tokens']:,} |")
    sources = ", ".join(f"`{s['path']}` ({s['format']}, {s['split']})" for s in manifest.get("sources", []))
    return "\n".join(rows) + (f"\n\nSources: {sources}." if sources else "")


def report_is_for(report: dict | None, checkpoint: str, step: int) -> bool:
    """The validation report measured this checkpoint: the same head weights (sha256 of head.safetensors),
    or, for a report without the hash, the same step and checkpoint directory name."""
    head = (report or {}).get("head") or {}
    if not report:
        return False
    if head.get("sha256"):
        return head["sha256"] == sha256_file(Path(checkpoint) / "head.safetensors")
    return head.get("step") == step and Path(str(head.get("checkpoint", ""))).name == Path(checkpoint).name


def _validation(report: dict | None, c: "CardInputs") -> str:
    if not report:
        return "No validation report (`run_dir/validation/report.json`): run `mtp-train validate` before exporting."
    if not report_is_for(report, c.checkpoint, c.meta["step"]):
        head = report.get("head") or {}
        return (f"The run's validation report (`run_dir/validation/report.json`) measured "
                f"`{head.get('checkpoint')}` (step {head.get('step')}), not this checkpoint; its figures are left "
                "out. Validate this checkpoint, then export again.")
    return ("Figures of `mtp-train validate` for the exported checkpoint (τ: tokens per target forward, bonus "
            "included; acceptance: P(drafts 1..j all kept)):\n\n```\n" + format_table(report) + "\n```")


def _serving(layout: str, out: Path, c: CardInputs) -> str:
    """How to serve the directory `out` of this layout, in the engines that load it."""
    if layout in ("eagle3", "eagle3-speculators"):
        return _serving_eagle3(layout, out, c)
    if layout == "vllm-mtp":
        return _serving_vllm_mtp(out, c)
    return SERVING.get(layout, _serving_deepseek_nextn)(out, c)


def _serving_hf_mtp_stitched(out: Path, c: CardInputs) -> str:
    n = c.target_config.get("num_hidden_layers")
    target = c.target_path
    return f"""This directory is the target with the head added as MTP layer {n}: the target's files are
links to `{target}`, the head is `model-mtp.safetensors`, and `config.json` / the weight index name it.

**transformers** (>= 5.14; greedy output is the target's own, the head drafts one token per step; batch 1):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
path = "{out}"
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
# Llama / Qwen model classes register no MTP key pattern; MtpModel finds the layer's weights through this:
model._keys_to_ignore_on_load_unexpected = [r"model\\.layers\\.{n}\\..*"]
inputs = tok.apply_chat_template([{{"role": "user", "content": "Hi"}}], add_generation_prompt=True,
                                return_tensors="pt", return_dict=True)
out = model.generate(**inputs, use_mtp=True, do_sample=False, max_new_tokens=128)
```

Loading reports the `model.layers.{n}.*` tensors as unexpected: the main model does not use them,
`generate(use_mtp=True)` loads them into transformers' `MtpModel`.

{_no_engine_mtp(c)}"""


def _serving_hf_mtp(out: Path, c: CardInputs) -> str:
    n = c.target_config.get("num_hidden_layers")
    return f"""The head alone, as transformers' MTP layer {n} of the target (`model.safetensors` holds
only the `model.layers.{n}.*` tensors; `config.json` is the target's plus `num_mtp_layers: 1`). To serve it,
add its tensors to a copy of the target directory and use this config: `hf-mtp-stitched` beside this
directory is exactly that copy (see its card for the transformers command).

{_no_engine_mtp(c)}"""


def _serving_eagle_vllm(out: Path, c: CardInputs) -> str:
    target = c.target_path
    return f"""**vLLM** (EAGLE-1 draft, `EagleLlamaForCausalLM`):

```bash
vllm serve {target} --speculative-config '{{"method": "eagle", "model": "{out}", "num_speculative_tokens": 3}}'
```

vLLM's EAGLE `fc` has no bias: when the head has one, it is folded into the layer's q/k/v/o biases
(`attention_bias: true` in `config.json`; the same function, checked when exporting). For SGLang use
`eagle-sglang` beside this directory."""


def _serving_eagle_sglang(out: Path, c: CardInputs) -> str:
    target = c.target_path
    return f"""**SGLang** (EAGLE-1 draft, `LlamaForCausalLMEagle`):

```bash
python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE \\
    --speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 \\
    --speculative-num-draft-tokens 4
```

SGLang's EAGLE `fc` always has a bias (zeros here when the head was trained without one). For vLLM use
`eagle-vllm` beside this directory."""


def _serving_deepseek_eagle(out: Path, c: CardInputs) -> str:
    n = c.target_config.get("num_hidden_layers")
    target = c.target_path
    return f"""**vLLM** (>= 0.32, `EagleDeepSeekMTPModel`, vLLM's own EAGLE head for DeepSeek targets:
vllm/model_executor/models/deepseek_eagle.py): enorm, hnorm, `fc` (the head's eh_proj), one DeepSeek-V2
decoder layer (`layers.0.*`, built by vLLM as layer {n}, after the target's), `norm` (the head's post_norm), whose output is
both what the target's lm_head reads and the next draft step's hidden state. `config.json` sets
`first_k_dense_replace: {n + 1}`, so vLLM builds layer {n} with the dense MLP the head has. The embedding and
lm_head are the target's (this directory holds neither).

```bash
vllm serve {target} --speculative-config '{{"method": "eagle", "model": "{out}", "num_speculative_tokens": 3}}'
```

On CPUs, vLLM 0.32 decodes DeepSeek-V2 targets only through its reference MLA backend
(`--attention-backend CPU_MLA`; the AMX one refuses fp32 weights), which does not decode them as transformers
does (`make test-serving` records both)."""


def _serving_deepseek_nextn(out: Path, c: CardInputs) -> str:
    n = c.target_config.get("num_hidden_layers")
    return f"""The NextN layout of DeepSeek-V3's MTP module (`model.layers.{n}.*`, `DeepSeekMTPModel`; this
directory's `config.json` makes layer {n} dense, as the head is), kept for engines that read DeepSeek-V3's MTP
keys. **To serve this head in vLLM, use `deepseek-eagle` beside this directory** (vLLM's `EagleDeepSeekMTPModel`,
method `eagle`). No engine we know of loads this directory as it stands:

- **vLLM** 0.32 (its CPU build, tried by `make test-serving`, which records the error):
  `--speculative-config '{{"method": "mtp", "model": "{out}", "num_speculative_tokens": 1}}'` is refused
  (`Unsupported speculative method`: vLLM maps `deepseek_v3` drafts to its MTP model, not `deepseek_v2`
  ones), and its `DeepSeekMTP` builds the layer from the *target's* config (`num_nextn_predict_layers`,
  an MoE MLP past `first_k_dense_replace`): vLLM serves DeepSeek MTP layers from the target's own checkpoint,
  as DeepSeek-V3 ships them.
- **SGLang** builds its NextN layer with the MoE MLP whatever the config says
  (python/sglang/srt/models/deepseek_v2.py, `_is_layer_sparse`), and **transformers** builds MTP layers
  of DeepSeek models as MoE too (`get_mtp_config` sets `first_k_dense_replace = 0`).

This head's MLP is dense (docs/design.md §3); an MoE head for DeepSeek targets is what would make this layout servable."""


# layout -> its serving section (eagle3 and vllm-mtp take more; anything else is deepseek-nextn)
SERVING = {"hf-mtp-stitched": _serving_hf_mtp_stitched, "hf-mtp": _serving_hf_mtp, "eagle-vllm": _serving_eagle_vllm,
           "eagle-sglang": _serving_eagle_sglang, "deepseek-eagle": _serving_deepseek_eagle}


def _serving_eagle3(layout: str, out: Path, c: CardInputs) -> str:
    aux = c.meta["head"].get("aux_layers") or []
    ids = f"{aux}" if aux else "(2, L//2, L-3)"
    k = 5
    options = {k: bool(c.meta["head"].get(k)) for k in ("norm_before_residual", "norm_before_fc", "norm_output")}
    said = [("`norm_before_residual` is true (the residual is `hidden_norm` of the fused features)"
             if options["norm_before_residual"] else "`norm_before_residual` is false (the residual is the fused "
             "features before `hidden_norm`, as SpecForge trains and SGLang runs it)"),
            ("`norm_before_fc` is true (`input_norm.weight`, one RMSNorm over the concatenated aux states before "
             "`fc`, vLLM's option)" if options["norm_before_fc"] else "`norm_before_fc` is false")]
    if options["norm_output"]:
        said.append("`norm_output` is true (the chain feeds `norm(z)`, what the lm_head read, back as the next "
                    "step's hidden state)")
    norm_text = "; ".join(said) + "."
    layers = int(c.meta["head"].get("num_layers") or 1)
    if layers > 1:
        norm_text += (f" The head has {layers} decoder layers: the EAGLE-3 layer, then plain Llama layers "
                      f"`layers.1` .. `layers.{layers - 1}` (`num_hidden_layers: {layers}`, as vLLM's `llama_eagle3` "
                      "builds them).")
    vllm_only = any(options.values()) or layers > 1
    why = ("its EAGLE-3 model serves one decoder layer and this head has " + str(layers) if layers > 1 else
           "its EAGLE-3 layer has none of `norm_before_residual`, `norm_before_fc` and `norm_output`, and reading "
           "these weights without them would draft from other logits")
    sglang_text = (f"**SGLang** does not serve this head: {why}."
                   if vllm_only else f"""**SGLang**:

```bash
python -m sglang.launch_server --model-path {c.target_path} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {out} --speculative-num-steps {k} --speculative-eagle-topk 1 \\
    --speculative-num-draft-tokens {k + 1}
```""")
    conventions = f"""The head reads the residual stream entering target layers {ids} (transformers'
`hidden_states[i]`). `config.json` writes them in each engine's convention: vLLM's top-level
`eagle_aux_hidden_state_layer_ids` counts "input to layer i" (the same numbers); SGLang's
`eagle_config.eagle_aux_hidden_state_layer_ids` counts "output of layer j" (one less: SGLang adds one before
capturing). `d2t` holds offsets (target id = draft id + d2t[draft id]), `t2d` marks the target ids inside the
draft vocabulary ({c.meta['head'].get('draft_vocab')} tokens); {norm_text} Each engine's reading of
these files (ids, offsets, norms) was checked to give the trained head's logits exactly when exporting."""
    if layout == "eagle3-speculators":
        return f"""**vLLM** (speculators format, `Eagle3Speculator`; `speculators_config.verifier` names the target):

```bash
vllm serve {out}                     # the verifier named in config.json, {SPECULATIVE_TOKENS} draft tokens
vllm serve {c.target_path} --speculative-config '{{"model": "{out}", "num_speculative_tokens": {k}}}'
```

`norm_before_residual` is written explicitly: vLLM's speculators path takes it as true when it is absent, which
for a head trained without it would add the normalised features to the attention output and collapse acceptance
silently.

{conventions}"""
    return f"""**vLLM** (`LlamaForCausalLMEagle3`):

```bash
vllm serve {c.target_path} --speculative-config '{{"method": "eagle3", "model": "{out}", "num_speculative_tokens": {k}}}'
```

{sglang_text}

{conventions}"""


def plugin_dir() -> Path:
    """Where the vLLM plugin package lies in this checkout of mtp_train (serving/vllm_plugin)."""
    return Path(__file__).resolve().parents[2] / "serving" / "vllm_plugin"


def _serving_vllm_mtp(out: Path, c: CardInputs) -> str:
    n = c.meta["head"].get("draft_vocab", 0)
    vocab = (f" With the head's draft vocabulary ({n:,} tokens, `draft_vocab_size` in `config.json`, `d2t` in the "
             "weights: target id = draft id + d2t[draft id]) the plugin sets the logits outside it to -inf, which "
             "is what the trained head drafts from." if n else "")
    return f"""**vLLM** (>= 0.32) with mtp_train's plugin, which adds this head's architecture
(`EagleMtpHeadForCausalLM`: enorm, hnorm, eh_proj, the target family's decoder layer with its input norm,
post_norm) to vLLM through its `vllm.general_plugins` entry point. Install it into vLLM's environment once
(it needs vllm and torch only; the directory is in the mtp_train repository):

```bash
pip install {plugin_dir()}
vllm serve {c.target_path} --speculative-config '{{"method": "eagle", "model": "{out}", "num_speculative_tokens": 3}}'
```

vLLM's EAGLE proposer runs the head: its post-norm output is both what the target's lm_head reads (shared, as
is the embedding: this directory holds neither) and the hidden state of the next draft step, as in our
drafter.{vocab} The decoder layer is vLLM's own tensor-parallel one (`--tensor-parallel-size` works as for the
target)."""


def _no_engine_mtp(c: CardInputs) -> str:
    if c.target_config.get("model_type") in ("llama", "qwen2", "qwen3"):
        return ("**vLLM**: `vllm-mtp` beside this directory is this head for vLLM with mtp_train's plugin "
                "(its card gives the install line and the `vllm serve` command). **SGLang**: its MTP loaders are "
                "written per model family (DeepSeek, MiMo, GLM, ...) and none loads an MTP layer of a "
                f"`{c.target_config.get('model_type')}` target; train an `eagle1` head (`head.variant=eagle1`) "
                "and export it with `format=eagle` for it.")
    return (f"**vLLM / SGLang**: their MTP loaders are written per model family (DeepSeek, MiMo, GLM, ...; "
            f"vLLM's `_SPECULATIVE_DECODING_MODELS` registry) and none of those read for this exporter loads an "
            f"MTP layer of a "
            f"`{c.target_config.get('model_type')}` target. To serve with them, train an `eagle1` head "
            "(`head.variant=eagle1`) and export it with `format=eagle`.")


def model_card(layout: str, out: Path, files: list[tuple[str, int]], c: CardInputs) -> str:
    """README.md for the export directory `out` (final path) of `layout`; `files` are (name, bytes)."""
    listing = "\n".join(f"| `{name}` | {size:,} |" for name, size in files)
    return f"""# Draft head `{c.meta['variant']}` for `{Path(c.target_path).name}`, layout `{layout}`

A speculative-decoding draft head made by mtp_train {__version__}: it proposes the target's next tokens
from the target's final hidden state and the target's own embedding and `lm_head` (shared, not copied
unless the layout requires them).

## Identity

{_identity(c)}

{_draft_vocab(layout, c)}## How it was made

{_making(c)}

## Data

{_data(c.manifest)}

## Validation

{_validation(c.report, c)}

## Files

| file | bytes |
|---|---:|
{listing}

`export.json` records what made this directory; `mtp-train export` leaves a directory made from the same
inputs alone and refuses to replace a different one without `overwrite=true`.

## Serving

{_serving(layout, out, c)}
"""
