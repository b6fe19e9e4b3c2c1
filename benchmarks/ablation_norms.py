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
import sys
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


def with_val_subset(base: Path, work: Path, n: int) -> Path:
    """A run_dir sharing `base`'s data and train store, whose val store holds `n` of base's val samples
    (evenly spaced, so every kind of sample stays represented): evaluating 12 heads on all of it would cost
    more than training them."""
    from mtp_train.store.format import write_split
    from mtp_train.store.reader import StoreReader

    out = work / f"base-val{n}"
    if (out / "store" / "val" / "manifest.json").is_file():
        return out
    (out / "store").mkdir(parents=True, exist_ok=True)
    for link, target in ((out / "data", base / "data"), (out / "store" / "train", base / "store" / "train")):
        if not link.exists():
            link.symlink_to(target.resolve())
    val = StoreReader(base / "store" / "val")
    picks = sorted({round(i * (len(val) - 1) / max(1, n - 1)) for i in range(min(n, len(val)))})
    identity = {k: val.manifest[k] for k in ("target", "tokenizer", "data")}
    write_split(out / "store" / "val", [val[i] for i in picks], identity=identity, dtype=val.dtype)
    return out


def train_one(base: Path, work: Path, variant: str, lr: float, seed: int, args) -> dict:
    from mtp_train.config import compose
    from mtp_train.train.trainer import Trainer

    class FinalEvalOnly(Trainer):  # the untrained head's validation is not part of this comparison
        def validate(self, full: bool = True) -> dict:
            return {} if self.step == 0 else super().validate(full)

    run_dir = work / f"{variant}-lr{lr:g}-s{seed}"
    done = run_dir / "result.json"
    if done.is_file():  # finished by an earlier invocation with the same settings: reused
        result = json.loads(done.read_text())
        if result.get("args") == key_args(args):
            return result
    run_dir.mkdir(parents=True, exist_ok=True)
    for part in ("data", "store"):
        link = run_dir / part
        if not link.exists():
            link.symlink_to((base / part).resolve())
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
    summary = FinalEvalOnly(cfg).fit()
    result = {"variant": variant, "lr": lr, "seed": seed, "acc": summary["final"]["d1/acc"],
              "accept": summary["final"]["d1/accept"], "ce": summary["final"]["d1/ce"],
              "seconds": time.perf_counter() - t0, "args": key_args(args)}
    done.write_text(json.dumps(result) + "\n")
    return result


def key_args(args) -> dict:
    """The settings a finished run's result depends on."""
    return {"steps": args.steps, "micro_batch": args.micro_batch, "warmup": args.warmup,
            "max_length": args.max_length, "val_samples": args.val_samples}


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_ablation"))
    ap.add_argument("--base", type=Path, help="a run_dir of the tiny recipe whose data/ and store/ to reuse "
                    "(e.g. runs/demo after `make demo`); default: prepare and precompute under --work")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--val-samples", type=int, default=192, help="val samples each head is evaluated on")
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    base = args.base.resolve() if args.base else prepared(args.work, args.max_length)
    base = with_val_subset(base, args.work, args.val_samples)
    # seeds outermost, the two variants side by side: a run cut short still compares like with like
    runs = [train_one(base, args.work, v, lr, s, args) for s in args.seeds for lr in args.lrs
            for v in ("mtp", "eagle1")]
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
              "command": "python benchmarks/ablation_norms.py " + " ".join(sys.argv[1:]), "args": {k: str(v) if isinstance(v, Path) else v
                                                                         for k, v in vars(args).items()},
              "runs": runs, "table": table, "best": best,
              "delta_best_acc": best["mtp"]["acc_mean"] - best["eagle1"]["acc_mean"],
              "delta_best_accept": best["mtp"]["accept_mean"] - best["eagle1"]["accept_mean"]}
    print(f"\nablation: {args.steps} steps x {args.micro_batch} samples (max {args.max_length} tokens), depth 1, "
          f"seeds {args.seeds}; validation at depth 1 on {args.val_samples} val samples")
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
