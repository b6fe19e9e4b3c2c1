"""Regeneration (self-distillation, `data.regenerate=true`) in-process against through a vLLM server
(`data.regenerate_server`), on the same conversations of a recipe, side by side on one machine.

    .venv/bin/python benchmarks/regenerate_server.py --vllm-python .venv-vllm/bin/python \\
        [--recipe smollm2-135m] [--conversations 32] [--concurrency 16] [--out runs/bench_regen]

Runs `mtp-train prepare` twice on the recipe cut to `--conversations` training conversations (4 validation
ones, 1 document): once regenerating with our engine in this process, once sending the prompts to `vllm serve`
(vLLM's own venv, fp32, `--enforce-eager`) started on 127.0.0.1 for the run. Prints a table (generated tokens,
regeneration seconds and tokens/s from each manifest, samples token-for-token identical between the two
datasets) and writes benchmarks/results/regenerate_server.json. Greedy both ways: the datasets should agree
but for near-ties, which the engines' other summation orders may split.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def prepare(recipe: str, run_dir: Path, cut: list[str], *extra: str) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "mtp_train.cli", "prepare", f"recipe={recipe}", f"run_dir={run_dir}",
           "target.device=cpu", *cut, *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads((run_dir / "data" / "manifest.json").read_text())["regenerate"]


def serve(python: str, model: str, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    server = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                               "--served-model-name", "target", "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 900
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited {server.returncode}: see {log}")
        try:
            urllib.request.urlopen(url + "/models", timeout=5)
            return server, url
        except OSError:
            if time.time() > deadline:
                server.terminate()
                raise RuntimeError(f"vllm serve did not answer within 900 s: see {log}")
            time.sleep(3)


def identical(a: Path, b: Path) -> dict:
    """Samples token for token the same per split: `tests/serving/same_replies.py`, as `make test-serving` counts."""
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "serving" / "same_replies.py"), str(a), str(b)],
                          check=True, capture_output=True, text=True)
    return {k: v for k, v in json.loads(done.stdout).items() if k != "regenerate"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_regen")
    args = ap.parse_args()
    from mtp_train.config import compose

    cfg = compose(args.recipe, ["run_dir=/tmp/unused"])
    cut = [f"data.sources.0.limit={args.conversations}", "data.sources.1.limit=1", "data.sources.2.limit=4",
           "data.regenerate=true"]
    args.out.mkdir(parents=True, exist_ok=True)
    ours = prepare(args.recipe, args.out / "ours", cut)
    server, url = serve(args.vllm_python, cfg.target.path, args.out / "vllm-serve.log")
    try:
        theirs = prepare(args.recipe, args.out / "vllm", cut, f"data.regenerate_server={url}",
                         f"data.regen_concurrency={args.concurrency}")
    finally:
        server.terminate()
        server.wait(timeout=120)
    same = identical(args.out / "ours" / "data", args.out / "vllm" / "data")
    rows = [("ours (in-process)", ours), (f"vLLM server, concurrency {args.concurrency}", theirs)]
    print(f"\n{args.recipe}: {args.conversations} conversations, greedy, max {ours['max_new_tokens']} new tokens")
    print("| engine | turns | generated tokens | seconds | tokens/s |\n|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['turns']} | {r['generated_tokens']:,} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} |")
    print(f"vLLM / ours throughput: {theirs['tokens_per_s'] / ours['tokens_per_s']:.2f}x; identical samples: "
          + ", ".join(f"{k} {v['identical']}/{v['samples']}" for k, v in same.items()))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "command": " ".join(sys.argv), "recipe": args.recipe,
              "conversations": args.conversations, "ours": ours, "vllm": theirs, "identical": same,
              "ratio": theirs["tokens_per_s"] / ours["tokens_per_s"]}
    path = ROOT / "benchmarks" / "results" / "regenerate_server.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
