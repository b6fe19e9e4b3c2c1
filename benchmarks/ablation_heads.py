"""`mtp` against `eagle1` against `eagle3`: the same data, store, optimizer steps and samples per step.

One prepared dataset and one store (holding the eagle3 aux layers beside the final hidden state, which the
other two ignore) serve every run; every variant drafts over the same draft vocabulary; each trains its own
depth (default: mtp and eagle1 3 steps deep, eagle3 7, its training-time test). Per variant and seed:

* teacher-forced top-1 agreement and expected acceptance Σ min(p, q) at depths 1..5 on the val store
  (`mtp_train.validate.teacher_forced`, the trainer's own evaluation);
* greedy τ at k = 1..5 from real speculative decoding of held-out prompts (`validate.decoding`), with the
  output checked to be the target's own.

    python benchmarks/ablation_heads.py                          # tiny target, 3 seeds
    python benchmarks/ablation_heads.py --recipe smollm2-135m --base runs/smollm2-135m --seeds 0

Prints a table (mean ± sd over seeds) and writes benchmarks/results/ablation_heads[-RECIPE].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import PLAIN_HEAD, command, machine  # noqa: E402

VARIANTS = ("mtp", "eagle1", "eagle3")
DEPTH = 5  # teacher-forced depths and greedy k reported
AUX = {"tiny": [1, 2, 3]}  # the tiny target's 4 layers repeat one in the default (2, L//2, L-3)


def overrides(args, variant: str) -> list[str]:
    aux = AUX.get(args.recipe)
    out = [*PLAIN_HEAD, f"head.variant={variant}", f"head.draft_vocab={args.draft_vocab}",
           f"train.depth={args.eagle3_depth if variant == 'eagle3' else args.depth}"]
    if variant == "eagle3":
        out += ["train.loss.w_feat=0"] + ([f"head.aux_layers=[{','.join(map(str, aux))}]"] if aux else [])
    return out


def prepared(args) -> Path:
    """A run_dir with data/ and a store holding the aux layers (made once; `--base` reuses a run's data/)."""
    from mtp_train.config import compose
    from mtp_train.data.prepare import run as prepare
    from mtp_train.model.head import aux_layer_ids
    from mtp_train.store.precompute import run as precompute
    from transformers import AutoConfig

    base = args.work / "base"
    cfg = compose(args.recipe, [f"run_dir={base}", *overrides(args, "eagle3")])
    aux = aux_layer_ids(AutoConfig.from_pretrained(cfg.target.path), cfg.head)
    cfg = compose(args.recipe, [f"run_dir={base}", f"store.layers=[{','.join(map(str, aux))}]",
                                *overrides(args, "eagle3")])
    if args.base is not None and not (base / "data").exists():  # reuse a run's prepared data (regeneration is slow)
        base.mkdir(parents=True, exist_ok=True)
        (base / "data").symlink_to((args.base / "data").resolve())
    if args.base is None:
        prepare(cfg)
    precompute(cfg)
    return base


def link_base(run_dir: Path, base: Path) -> None:
    """run_dir/data and run_dir/store linked to the base run's (one prepared dataset and store for every run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for part in ("data", "store"):
        if not (run_dir / part).exists():
            (run_dir / part).symlink_to((base / part).resolve())


def train_fresh(cfg):
    """Train cfg's head from scratch (an earlier run's checkpoints and metrics removed) -> (trainer, seconds)."""
    import shutil

    from mtp_train.train.trainer import Trainer

    shutil.rmtree(Path(cfg.run_dir) / "checkpoints", ignore_errors=True)
    (Path(cfg.run_dir) / "metrics.jsonl").unlink(missing_ok=True)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    trainer.fit()
    return trainer, time.perf_counter() - t0


def train_one(base: Path, variant: str, seed: int, args) -> dict:
    from mtp_train.config import compose
    from mtp_train.inference.runner import load_runner
    from mtp_train.inference.load import load_head, stop_tokens
    from mtp_train.model.target import load_tokenizer
    from mtp_train.data.held_out import held_out_prompts
    from mtp_train.validate.decoding import decoding
    from mtp_train.validate.teacher_forced import teacher_forced

    run_dir = args.work / f"{variant}-s{seed}"
    done = run_dir / "result.json"
    key = key_args(args)
    if done.is_file() and json.loads(done.read_text()).get("args") == key:
        return json.loads(done.read_text())  # finished by an earlier invocation with the same settings
    link_base(run_dir, base)
    cfg = compose(args.recipe, [f"run_dir={run_dir}", *overrides(args, variant), f"train.seed={seed}",
                                f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=0",
                                "train.keep_checkpoints=1", f"validate.val_samples={args.val_samples}",
                                f"validate.num_prompts={args.prompts}", f"validate.max_new_tokens={args.new_tokens}",
                                f"validate.max_k={DEPTH}", "validate.temperatures=[0]", "resume=false"])
    trainer, seconds = train_fresh(cfg)
    tf = teacher_forced(cfg, trainer.head.eval(), trainer.frozen, trainer.device, DEPTH)
    target = load_runner(cfg.target.path, cfg.target)
    drafter = load_head(cfg, target)[0]
    prompts, _ = held_out_prompts(run_dir / "data", args.prompts, cfg.validate.max_prompt_tokens)
    entries, _, _ = decoding(cfg, target, {"head": drafter}, prompts, stop_tokens(load_tokenizer(cfg.target.path), target),
                             say=lambda *a: None)
    result = {"variant": variant, "seed": seed, "train_seconds": seconds, "depth": cfg.train.depth,
              "params": sum(p.numel() for p in trainer.head.parameters()),
              "acc": tf["accuracy_by_depth"], "accept": tf["expected_acceptance_by_depth"],
              "tau": [e["tau"] for e in entries], "greedy_identical": all(e["greedy_identical"] for e in entries),
              "args": key}
    done.write_text(json.dumps(result) + "\n")
    print(f"{variant} seed {seed}: d1..{DEPTH} acc {' '.join(f'{a:.3f}' for a in result['acc'])}; tau k=1..{DEPTH} "
          f"{' '.join(f'{t:.2f}' for t in result['tau'])} ({seconds:.0f} s training)", flush=True)
    return result


def key_args(args) -> dict:
    return {k: getattr(args, k) for k in ("recipe", "steps", "depth", "eagle3_depth", "draft_vocab", "val_samples",
                                          "prompts", "new_tokens")}


def stat(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--work", type=Path, help="default runs/bench_heads[-RECIPE]")
    ap.add_argument("--base", type=Path, help="a run_dir of the recipe whose prepared data/ to reuse")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--depth", type=int, default=3, help="training depth of mtp and eagle1")
    ap.add_argument("--eagle3-depth", type=int, default=7, help="training depth of eagle3 (its training-time test)")
    ap.add_argument("--draft-vocab", type=int, default=1024, help="the same draft vocabulary for every variant")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--val-samples", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    suffix = "" if args.recipe == "tiny" else f"-{args.recipe}"
    args.work = (args.work or Path(f"runs/bench_heads{suffix}")).resolve()
    args.base = args.base.resolve() if args.base else None
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    base = prepared(args)
    runs = [train_one(base, v, s, args) for s in args.seeds for v in VARIANTS]  # seeds outermost: like with like
    table = []
    for v in VARIANTS:
        rs = [r for r in runs if r["variant"] == v]
        table.append({"variant": v, "depth": rs[0]["depth"], "params": rs[0]["params"], "seeds": len(rs),
                      "acc": [stat([r["acc"][j] for r in rs]) for j in range(DEPTH)],
                      "accept": [stat([r["accept"][j] for r in rs]) for j in range(DEPTH)],
                      "tau": [stat([r["tau"][j] for r in rs]) for j in range(DEPTH)],
                      "tau_mean": [statistics.fmean(r["tau"][j] for r in rs) for j in range(DEPTH)],
                      "greedy_identical": all(r["greedy_identical"] for r in rs),
                      "train_seconds": statistics.fmean(r["train_seconds"] for r in rs)})
    print(f"\nablation_heads on {args.recipe}: {args.steps} steps each, draft vocabulary {args.draft_vocab}, "
          f"seeds {args.seeds}; teacher-forced on {args.val_samples} val samples; greedy tau on {args.prompts} "
          f"held-out prompts x {args.new_tokens} tokens")
    for name in ("acc", "accept", "tau"):
        print(f"\n{name + (' (teacher-forced)' if name != 'tau' else ' (greedy, k = 1..5)'):<28}"
              + "".join(f"{j:>17}" for j in range(1, DEPTH + 1)))
        for t in table:
            print(f"{t['variant'] + ' (depth ' + str(t['depth']) + ')':<28}" + "".join(f"{x:>17}" for x in t[name]))
    print("\ngreedy output identical to the target's: " + ", ".join(f"{t['variant']} {t['greedy_identical']}"
                                                                   for t in table))
    out = Path(__file__).resolve().parent / "results" / f"ablation_heads{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(torch.get_num_threads()),
                               "command": command("ablation_heads.py", args),
                               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "runs": runs, "table": table}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
