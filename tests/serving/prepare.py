"""Step 1 of `make test-serving`, run with mtp_train's own venv: train small heads on the embedded tiny target,
export every layout vLLM reads, and decode held-out prompts with our engine, so that the vLLM tests (step 2,
in vLLM's venv, which has no mtp_train) read only files: the export directories and `manifest.json`.

    python tests/serving/prepare.py OUT_DIR [--steps 60]

manifest.json: the target's path, the prompts (token ids), the new-token budget, the in-process regeneration
of 48 tiny conversations (`regen-ours/data`, to compare with the same through a vLLM server), and per case (a layout and the
method vLLM serves it with) the export directory, k, and what our engine did on the same prompts, greedy: the
tokens of the target alone and with the head, verification steps and accepted drafts by position. Reruns
reuse finished runs (a run dir with an export is not trained again).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# regeneration, in-process here and through a vLLM server in the test: the tiny recipe cut to 48 conversations
REGEN = ["data.sources.0.limit=2", "data.sources.1.limit=48", "data.sources.2.limit=1", "data.sources.3.limit=8",
         "data.regenerate=true", "data.regen_max_new_tokens=64"]
K = 3
NEW_TOKENS = 48  # benchmarks/vllm_generate.py decodes as many
PROMPTS = 8

# (case, recipe, overrides, export format, export subdirectory, vLLM speculative method)
CASES = [
    ("eagle-vllm", "tiny", ["head.variant=eagle1"], "eagle", "eagle-vllm", "eagle"),
    ("eagle3", "tiny-eagle3", [], "eagle3", "eagle3", "eagle3"),
    ("eagle3-speculators", "tiny-eagle3", [], "eagle3", "eagle3-speculators", "eagle3"),
]


def mtp_train(*args: str) -> None:
    cmd = [sys.executable, "-m", "mtp_train.cli", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def train_and_export(run_dir: Path, recipe: str, overrides: list[str], fmt: str, steps: int) -> Path:
    export = run_dir / "export"
    common = [f"recipe={recipe}", f"run_dir={run_dir}", "target.device=cpu", *overrides]
    if not (export / "model_card.md").exists() and not any(export.glob("*/config.json")):
        for stage in ("prepare", "precompute"):
            mtp_train(stage, *common)
        mtp_train("train", *common, f"train.steps={steps}", "train.eval_every=0", "resume=true")
        mtp_train("export", *common, f"export.format={fmt}")
    return export


def ours(run_dir: Path, recipe: str, overrides: list[str], prompts: list[list[int]]) -> dict:
    """Greedy decoding of the prompts with our engine: the target alone, then the head at k = K."""
    from mtp_train.config import compose
    from mtp_train.inference import generate, load_runner
    from mtp_train.inference.load import load_drafter, stop_tokens
    from mtp_train.model.target import load_tokenizer

    cfg = compose(recipe, [f"run_dir={run_dir}", "target.device=cpu", *overrides])
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_runner(cfg.target.path, cfg.target)
    stop = stop_tokens(tokenizer, target)
    alone = generate(target, prompts, max_new_tokens=NEW_TOKENS, stop_tokens=stop)
    drafter = load_drafter(cfg, "head", target, tokenizer)
    tokens, steps, accepted = [], 0, [0] * K
    for p in prompts:  # batch 1, as vLLM's counters are compared per verification step
        out = generate(target, [p], drafter=drafter, k=K, max_new_tokens=NEW_TOKENS, stop_tokens=stop)
        tokens += out.tokens
        steps += out.stats.steps
        accepted = [a + b for a, b in zip(accepted, out.stats.accepted)]
    return {"target_only_tokens": alone.tokens, "tokens": tokens, "steps": steps, "accepted_per_position": accepted,
            "stop_tokens": sorted(stop)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from mtp_train.config import compose
    from mtp_train.validate import held_out_prompts

    manifest = {"k": K, "new_tokens": NEW_TOKENS, "cases": []}
    decoded: dict[Path, dict] = {}  # one head, two layouts: decoded once
    for case, recipe, overrides, fmt, sub, method in CASES:
        run_dir = out / f"run-{recipe}-{'-'.join(o.split('=')[-1] for o in overrides) or 'default'}"
        export = train_and_export(run_dir, recipe, overrides, fmt, args.steps)
        if "prompts" not in manifest:  # the first run's held-out prompts, for every case
            manifest["target"] = str(Path(compose(recipe, [f"run_dir={run_dir}"]).target.path).resolve())
            manifest["prompts"], manifest["prompt_source"] = held_out_prompts(run_dir / "data", PROMPTS, 512)
        if run_dir not in decoded:
            decoded[run_dir] = ours(run_dir, recipe, overrides, manifest["prompts"])
        manifest["cases"].append({"case": case, "method": method, "draft": str(export / sub), "k": K,
                                  "ours": decoded[run_dir]})
        print(f"{case}: exported to {export / sub}", flush=True)
    regen = out / "regen-ours"
    if not (regen / "data" / "manifest.json").exists():
        mtp_train("prepare", "recipe=tiny", f"run_dir={regen}", "target.device=cpu", *REGEN)
    manifest["regenerate"] = {"overrides": REGEN, "ours": str(regen / "data"), "mtp_train": str(Path(sys.executable)
                              .with_name("mtp-train")), "python": sys.executable}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out / 'manifest.json'}")


if __name__ == "__main__":
    main()
