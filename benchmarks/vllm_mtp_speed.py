"""vLLM's own decoding speed with our `mtp` head (the `vllm-mtp` export, through the plugin) against the target
alone, at batch 1 and batch 8, on the prompts of a `make test-serving` case.

    .venv/bin/python benchmarks/vllm_mtp_speed.py --vllm-python .venv-vllm/bin/python \\
        [--serving-dir runs/serving] [--case vllm-mtp] [--k 3] [--new-tokens 48]

Reads the case's target, export directory and held-out prompts from SERVING_DIR/manifest.json (prepare.py wrote
it), and runs `mtp_train/inference/vllm_run.py` with vLLM's Python four times: target alone and with the head,
`--max-num-seqs 1` (one request at a time) and 8 (all 8 prompts batched), greedy, fp32, enforce_eager. Timed is
vLLM's `generate` call only (engine start-up excluded); tokens/s = generated tokens / those seconds. Prints a
table and writes benchmarks/results/vllm_mtp_speed[-CASE].json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The processor's model name and core count (lscpu's "Model name"), e.g. "Intel(R) Xeon(R) Processor, 2 cores"."""
    import os

    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").is_file() else []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--serving-dir", type=Path, default=ROOT / "runs" / "serving")
    ap.add_argument("--case", default="vllm-mtp")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    manifest = json.loads((args.serving_dir / "manifest.json").read_text())
    case = next((c for c in manifest["cases"] if c["case"] == args.case), None)
    if case is None:
        sys.exit(f"{args.serving_dir / 'manifest.json'} has no case {args.case!r} (run tests/serving/prepare.py)")
    work = args.serving_dir / "speed"
    work.mkdir(exist_ok=True)
    prompts = work / f"prompts-{args.case}.json"
    prompts.write_text(json.dumps(case["prompts"]))
    rows = []
    for batch in (1, len(case["prompts"])):
        for spec in (None, ("eagle", case["draft"], str(args.k))):
            name = f"{'head' if spec else 'target'}-b{batch}"
            out = work / f"{args.case}-{name}.json"
            cmd = [args.vllm_python, str(ROOT / "mtp_train" / "inference" / "vllm_run.py"), case["target"], str(prompts),
                   str(out), *(spec or ()), "--max-tokens", str(args.new_tokens), "--max-num-seqs", str(batch)]
            print("+", " ".join(cmd), flush=True)
            with open(out.with_suffix(".log"), "w") as log:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1800,
                               env={**__import__("os").environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
            r = json.loads(out.read_text())
            if "error" in r:
                sys.exit(f"vLLM failed ({name}): {r['error']} (log {out.with_suffix('.log')})")
            tokens = sum(len(t) for t in r["tokens"])
            tau = (tokens / r["steps"]) if spec and r.get("steps") else None
            rows.append({"run": name, "batch": batch, "head": bool(spec), "tokens": tokens, "seconds": r["seconds"],
                         "tokens_per_s": tokens / r["seconds"], "steps": r.get("steps"),
                         "accepted_per_position": r.get("accepted_per_position"), "vllm_version": r["vllm_version"],
                         "tokens_per_step": tau})
    for batch in sorted({r["batch"] for r in rows}):
        base, head = (next(r for r in rows if r["batch"] == batch and r["head"] == h) for h in (False, True))
        head["speedup"] = head["tokens_per_s"] / base["tokens_per_s"]
    print("| batch | run | tokens | seconds | tokens/s | speed-up |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {'head k=' + str(args.k) if r['head'] else 'target alone'} | {r['tokens']} | "
              f"{r['seconds']:.2f} | {r['tokens_per_s']:.1f} | {r.get('speedup', 1.0):.2f}x |")
    out = ROOT / "benchmarks" / "results" / f"vllm_mtp_speed{'' if args.case == 'vllm-mtp' else '-' + args.case}.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": cpu_name(), "case": args.case, "target": case["target"],
                               "draft": case["draft"], "k": args.k, "new_tokens": args.new_tokens, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
