"""Restored norms or not: the `mtp` head against the original `eagle1` head on the tiny target.

Same prepared data and store, same steps, batch and schedule; a learning-rate sweep and several seeds per
variant. Reports the validation top-1 agreement with the target and the expected acceptance Σ min(p, q)
at depth 1 (mean ± standard deviation over seeds), per learning rate and at each variant's best rate.

    python benchmarks/ablation_norms.py            # table + benchmarks/results/ablation_norms.json

The write-up says restoring the norms adds a few points of accuracy; this measures it here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "ablation_norms.json"


def prepared(work: Path, max_length: int):
    """run_dir with data/ and store/ for the tiny recipe (made once, reused by every run)."""
    from mtp_train.config import compose
    from mtp_train.data.prepare import run as prepare
    from mtp_train.store.precompute import run as precompute

    cfg = compose("tiny", [f"run_dir={work / 'base'}", f"data.max_length={max_length}"])
    prepare(cfg)
    precompute(cfg)
    return work / "base"


def train_one(base: Path, work: Path, variant: str, lr: float, seed: int, args) -> dict:
    from mtp_train.config import compose
    from mtp_train.train.trainer import Trainer

    run_dir = work / f"{variant}-lr{lr:g}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for part in ("data", "store"):
        link = run_dir / part
        if not link.exists():
            link.symlink_to(base / part)
    for old in (run_dir / "checkpoints", run_dir / "metrics.jsonl"):
        if old.is_dir():
            import shutil

            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    cfg = compose("tiny", [f"run_dir={run_dir}", f"data.max_length={args.max_length}", f"head.variant={variant}",
                           f"train.lr={lr}", f"train.seed={seed}", f"train.steps={args.steps}",
                           f"train.micro_batch={args.micro_batch}", "train.depth=1", "train.eval_every=0",
                           "train.save_every=0", "train.keep_checkpoints=1", f"train.warmup_steps={args.warmup}"])
    t0 = time.perf_counter()
    summary = Trainer(cfg).fit()
    return {"variant": variant, "lr": lr, "seed": seed, "acc": summary["final"]["d1/acc"],
            "accept": summary["final"]["d1/accept"], "ce": summary["final"]["d1/ce"],
            "seconds": time.perf_counter() - t0}


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_ablation"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    base = prepared(args.work, args.max_length)
    runs = [train_one(base, args.work, v, lr, s, args) for v in ("mtp", "eagle1") for lr in args.lrs
            for s in args.seeds]
    table = []
    for v in ("mtp", "eagle1"):
        for lr in args.lrs:
            rs = [r for r in runs if r["variant"] == v and r["lr"] == lr]
            (am, asd), (pm, psd) = mean_sd([r["acc"] for r in rs]), mean_sd([r["accept"] for r in rs])
            table.append({"variant": v, "lr": lr, "acc_mean": am, "acc_sd": asd, "accept_mean": pm,
                          "accept_sd": psd, "seeds": len(rs)})
    best = {v: max((t for t in table if t["variant"] == v), key=lambda t: t["acc_mean"]) for v in ("mtp", "eagle1")}
    result = {"date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
              "command": "python benchmarks/ablation_norms.py", "args": {k: str(v) if isinstance(v, Path) else v
                                                                         for k, v in vars(args).items()},
              "runs": runs, "table": table, "best": best,
              "delta_best_acc": best["mtp"]["acc_mean"] - best["eagle1"]["acc_mean"],
              "delta_best_accept": best["mtp"]["accept_mean"] - best["eagle1"]["accept_mean"]}
    print(f"\nablation: {args.steps} steps x {args.micro_batch} samples (max {args.max_length} tokens), depth 1, "
          f"seeds {args.seeds}; validation at depth 1")
    print(f"{'variant':<8}{'lr':>8}{'top-1 acc':>18}{'expected accept':>20}")
    for t in table:
        print(f"{t['variant']:<8}{t['lr']:>8g}{t['acc_mean']:>11.3f} ± {t['acc_sd']:.3f}"
              f"{t['accept_mean']:>13.3f} ± {t['accept_sd']:.3f}")
    print(f"best lr: mtp {best['mtp']['lr']:g}, eagle1 {best['eagle1']['lr']:g}; mtp - eagle1 = "
          f"{result['delta_best_acc']:+.3f} acc, {result['delta_best_accept']:+.3f} accept")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
