"""Short probes of the EAGLE-3 depth collapse on SmolLM2 (ablation_heads: eagle3's teacher-forced accuracy falls
from 0.333 at depth 1 to 0.185 at depth 2, where mtp keeps 0.364 / 0.337): candidates trained on one store with
the same steps, samples, data order and seed, measured by the trainer's own teacher-forced evaluation on the val
store at depths 1..5 (`mtp_train.validate.teacher_forced`).

    python benchmarks/eagle3_collapse.py --base runs/smol-e3 --steps 50 [--candidates base nbr nbfc nbr+nbfc]

`--base` is a prepared and precomputed run of the smollm2-135m recipe with an eagle3 head (its store holds the aux
layers); every probe links its data and store. Candidates (`CANDIDATES`): the head's norm placements, lr, and the
training depth. Prints a table and writes benchmarks/results/eagle3_collapse.json. These are probes (one seed,
tens of steps): they rank candidates, they are not the recipe's final figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import PLAIN_HEAD, command, machine  # noqa: E402

DEPTH = 5
CANDIDATES = {
    "base": [],
    "nbr": ["head.norm_before_residual=true"],
    "nbfc": ["head.norm_before_fc=true"],
    "nbr+nbfc": ["head.norm_before_residual=true", "head.norm_before_fc=true"],
    "nbr+nbfc-lr1e-3": ["head.norm_before_residual=true", "head.norm_before_fc=true", "train.lr=1e-3"],
    "nbr-lr1e-3": ["head.norm_before_residual=true", "train.lr=1e-3"],
    "base-depth1": ["train.depth=1"],
}


def probe(name: str, args) -> dict:
    from ablation_heads import link_base, train_fresh
    from mtp_train.config import compose
    from mtp_train.validate.teacher_forced import teacher_forced

    run_dir = args.work / name
    done = run_dir / "result.json"
    key = {k: getattr(args, k) for k in ("steps", "micro_batch", "depth", "val_samples", "seed")}
    if done.is_file() and json.loads(done.read_text()).get("args") == key:
        return json.loads(done.read_text())
    link_base(run_dir, args.base)
    cfg = compose("smollm2-135m", [f"run_dir={run_dir}", *PLAIN_HEAD, "head.variant=eagle3", "train.loss.w_feat=0",
                                   f"store.layers={args.store_layers}", f"train.depth={args.depth}",
                                   f"train.steps={args.steps}", f"train.micro_batch={args.micro_batch}",
                                   f"train.warmup_steps={max(1, args.steps // 10)}", f"train.seed={args.seed}",
                                   "train.eval_every=0", "train.save_every=0", "train.keep_checkpoints=1",
                                   f"validate.val_samples={args.val_samples}", "resume=false", "target.device=cpu",
                                   *CANDIDATES[name]])
    trainer, seconds = train_fresh(cfg)
    tf = teacher_forced(cfg, trainer.head.eval(), trainer.frozen, trainer.device, DEPTH)
    result = {"candidate": name, "overrides": CANDIDATES[name], "depth": cfg.train.depth, "lr": cfg.train.lr,
              "acc": tf["accuracy_by_depth"], "accept": tf["expected_acceptance_by_depth"],
              "train_seconds": seconds, "args": key}
    done.write_text(json.dumps(result) + "\n")
    print(f"{name}: acc d1..{DEPTH} {' '.join(f'{a:.3f}' for a in result['acc'])}; accept "
          f"{' '.join(f'{a:.3f}' for a in result['accept'])} ({seconds:.0f} s training)", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("runs/eagle3_collapse"))
    ap.add_argument("--candidates", nargs="+", default=["base", "nbr", "nbfc", "nbr+nbfc"], choices=list(CANDIDATES))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3, help="training depth (the smollm2-135m recipe's)")
    ap.add_argument("--val-samples", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store-layers", default="[30]", help="the base run's store.layers (its store must match)")
    args = ap.parse_args()
    args.work, args.base = args.work.resolve(), args.base.resolve()
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    results = [probe(c, args) for c in args.candidates]
    print(f"\neagle3_collapse on smollm2-135m: {args.steps} steps x {args.micro_batch} samples, training depth "
          f"{args.depth} (unless the candidate sets it), seed {args.seed}; teacher-forced on {args.val_samples} val "
          "samples")
    print(f"{'candidate':<20}" + "".join(f"{'acc d' + str(j):>10}" for j in range(1, DEPTH + 1))
          + f"{'d2 - d1':>10}{'accept d1':>11}{'train s':>9}")
    for r in results:
        print(f"{r['candidate']:<20}" + "".join(f"{a:>10.3f}" for a in r["acc"])
              + f"{r['acc'][1] - r['acc'][0]:>10.3f}{r['accept'][0]:>11.3f}{r['train_seconds']:>9.0f}")
    out = Path(__file__).resolve().parent / "results" / "eagle3_collapse.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(torch.get_num_threads()),
                               "command": command("eagle3_collapse.py", args),
                               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
