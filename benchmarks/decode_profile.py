"""Where speculative decoding's time goes, op by op (torch.profiler), on any device and dtype.

    .venv/bin/python benchmarks/decode_profile.py --run-dir runs/tiny [--recipe tiny] [--device cuda]
        [--dtype bfloat16] [--drafter head] [--k 1] [--temperatures 0 1] [--prompts 4] [--new-tokens 48]

For each temperature: the target alone and the drafter at k, on the same held-out prompts at batch 1 (after a
warm-up decode of each), then one profiled decode of the drafter. Prints ms per step, tokens/s and the ops
with the most self time (CPU and, on a GPU, device); writes benchmarks/results/decode_profile-<device>-<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from mtp_train.config import compose
from mtp_train.inference.load import load_draft, load_head, stop_tokens
from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.runner import load_runner
from mtp_train.model.target import load_tokenizer
from mtp_train.data.held_out import held_out_prompts
from mtp_train.validate.decoding import decode_all

RESULTS = Path(__file__).resolve().parent / "results"


def top_ops(prof, key: str, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:n]
    return [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3} for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--drafter", default="head", choices=["head", "draft"])
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    cfg = compose(args.recipe, [f"run_dir={args.run_dir}", f"target.device={args.device}",
                                f"target.dtype={args.dtype}"])
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_runner(cfg.target.path, cfg.target)
    drafter = load_head(cfg, target)[0] if args.drafter == "head" else load_draft(cfg, target, tokenizer)
    prompts, source = held_out_prompts(Path(args.run_dir) / "data", args.prompts, 512)
    stop = stop_tokens(tokenizer, target)
    cuda = target.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    result = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(target.device) if cuda
              else platform.processor() or platform.machine(), "torch": torch.__version__, "args": {
                  k: str(v) for k, v in vars(args).items()}, "prompts": source, "rows": []}
    for t in args.temperatures:
        sampling = SamplingConfig(temperature=t)
        row = {"temperature": t}
        for name, d, k in (("none", None, 0), (args.drafter, drafter, args.k)):
            decode_all(target, d, prompts, k, sampling, args.new_tokens, stop, 1, 0)  # warm-up
            t0 = time.perf_counter()
            _, s = decode_all(target, d, prompts, k, sampling, args.new_tokens, stop, 1, 0)
            seconds = time.perf_counter() - t0
            row[name] = {"tokens_per_s": s.new_tokens / seconds, "ms_per_step": 1e3 * seconds / s.steps,
                         "steps": s.steps, "tau": s.tau if d is not None else 1.0}
        with torch.profiler.profile(activities=activities) as prof:
            decode_all(target, drafter, prompts, args.k, sampling, args.new_tokens, stop, 1, 0)
        row["top_self_cpu"] = top_ops(prof, "self_cpu_time_total", args.top)
        if cuda:
            row["top_self_device"] = top_ops(prof, "self_device_time_total", args.top)
        result["rows"].append(row)
        print(f"T={t:g}: target alone {row['none']['ms_per_step']:.2f} ms/step "
              f"({row['none']['tokens_per_s']:.1f} tok/s); {args.drafter} k={args.k}: "
              f"{row[args.drafter]['ms_per_step']:.2f} ms/step ({row[args.drafter]['tokens_per_s']:.1f} tok/s, "
              f"tau {row[args.drafter]['tau']:.2f})")
        for key in ("top_self_cpu", "top_self_device"):
            for op in row.get(key, []):
                print(f"  {key[4:]:12s} {op['op'][:60]:60s} {op['calls']:7d} calls  cpu {op['self_cpu_ms']:9.2f} ms"
                      f"  device {op['self_device_ms']:9.2f} ms")
    out = RESULTS / f"decode_profile-{target.device.type}-{args.dtype}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
