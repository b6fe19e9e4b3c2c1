"""`mtp-train prepare` throughput on the tiny recipe (the standard-library corpus), and self-distillation
(regenerating assistant turns with the tiny target) on a slice of it.

    .venv/bin/python benchmarks/prepare.py [--regen-conversations 32] [--regen-max-new-tokens 64]

Prints a table and writes benchmarks/results/prepare.json. Each run writes into a fresh temporary run_dir.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from datetime import date
from pathlib import Path

import torch

from mtp_train.config import compose
from mtp_train.data.prepare import run as prepare
from mtp_train.data.sources import SourceConfig

OUT = Path(__file__).resolve().parent / "results" / "prepare.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--regen-conversations", type=int, default=32)
    ap.add_argument("--regen-max-new-tokens", type=int, default=64)
    ap.add_argument("--regen-batch-size", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose("tiny", [f"run_dir={tmp}/full"])
        m = prepare(cfg)
        rows["prepare (tiny recipe)"] = {"samples": sum(s["samples"] for s in m["splits"].values()),
                                         "tokens": sum(s["tokens"] for s in m["splits"].values()),
                                         **m["throughput"], "splits": m["splits"], "counts": m["counts"]}
        cfg = compose("tiny", [f"run_dir={tmp}/regen", "data.regenerate=true",
                               f"data.regen_max_new_tokens={args.regen_max_new_tokens}",
                               f"data.regen_batch_size={args.regen_batch_size}"])
        cfg.data.sources = [SourceConfig(path="head-train", format="stdlib_chat", split="train",
                                         limit=args.regen_conversations)]
        m = prepare(cfg)
        rows["regenerate (greedy)"] = {"samples": m["regenerate"]["conversations"],
                                       "tokens": m["regenerate"]["generated_tokens"],
                                       "seconds": m["regenerate"]["seconds"],
                                       "samples_per_s": m["regenerate"]["samples_per_s"],
                                       "tokens_per_s": m["regenerate"]["tokens_per_s"]}
    print(f"tiny recipe on {platform.machine()}, {args.threads} threads, torch {torch.__version__}")
    print("| run | samples | tokens | seconds | samples/s | tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['samples']:,} | {r['tokens']:,} | {r['seconds']:.1f} | {r['samples_per_s']:,.1f} | "
              f"{r['tokens_per_s']:,.0f} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"date": date.today().isoformat(), "machine": f"{platform.machine()}, "
                               f"{args.threads} threads", "torch": torch.__version__, "args": vars(args),
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
