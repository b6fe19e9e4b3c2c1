"""What one speculative step costs against one target step, with each form of the CPU engine's few-row
projections side by side in one run: `stream` (`(W @ h.T).T`), `gemm` (BLAS's `h @ W.T`) and `probe` (what
`mtp_train.model.frozen.projection_form` measures faster on this machine, the default).

    .venv/bin/python benchmarks/step_cost.py --run-dir runs/smollm2-135m [--recipe smollm2-135m] [--steps 12]
        [--repeats 3] [--forms probe stream gemm] [--threads 2]

For each form, greedy steps at k = 0 (the target alone), 1 and 2 through the real decoding loop on one held-out
prompt (`predict.time_steps`, the timing validate's overhead term uses), the forms and k's in turns `--repeats`
times, medians. Prints ms per step and the k = 1 / k = 2 step in target steps; writes
benchmarks/results/step_cost-<recipe>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import date
from pathlib import Path

import torch
from timing import command, machine

from mtp_train.config import compose
from mtp_train.inference.runner import load_runner
from mtp_train.inference.load import load_head
from mtp_train.inference.predict import time_steps
from mtp_train.model import frozen
from mtp_train.data.held_out import held_out_prompts
from mtp_train.validate.decoding import processor_name

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--forms", nargs="+", default=["probe", "stream", "gemm"], choices=["probe", *frozen.FORMS])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = compose(args.recipe, [f"run_dir={args.run_dir}"])
    target = load_runner(cfg.target.path, cfg.target)
    drafter = load_head(cfg, target)[0]
    prompts, source = held_out_prompts(Path(args.run_dir) / "data", 1, 512)
    pinned = os.environ.get(frozen.PROJECTION_ENV)
    times: dict[str, dict[int, list[float]]] = {f: {k: [] for k in (0, 1, 2)} for f in args.forms}
    try:
        for f in args.forms:  # warm-up (and, for probe, the probes of every shape and row count the steps use)
            os.environ[frozen.PROJECTION_ENV] = f
            for k in (0, 1, 2):
                time_steps(target, drafter, prompts, k, 2)
        for _ in range(args.repeats):
            for f in args.forms:
                os.environ[frozen.PROJECTION_ENV] = f
                for k in (0, 1, 2):
                    times[f][k] += [ms for ms, _ in time_steps(target, drafter, prompts, k, args.steps)]
    finally:
        if pinned is None:
            os.environ.pop(frozen.PROJECTION_ENV, None)
        else:
            os.environ[frozen.PROJECTION_ENV] = pinned
    rows = []
    for f in args.forms:
        ms = {k: statistics.median(v) for k, v in times[f].items()}
        rows.append({"form": f, "ms": ms, "k1_in_target_steps": ms[1] / ms[0], "k2_in_target_steps": ms[2] / ms[0]})
    chosen = {f"{o}x{i} rows {r} {str(d).removeprefix('torch.')}": form
              for (o, i, r, d), form in sorted(frozen._chosen.items(), key=str)}
    result = {"date": date.today().isoformat(), "machine": {**machine(args.threads), "cpu": processor_name()},
              "command": command("step_cost.py", args), "recipe": args.recipe, "prompts": source,
              "rows": rows, "probed_forms": chosen}
    out = RESULTS / f"step_cost-{args.recipe}.json"
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{processor_name()}, {args.threads} threads, {args.recipe} ({cfg.head.variant} head), one prompt, "
          f"median of {args.repeats} x {args.steps} steps")
    print("| projections | target step | k = 1 step | k = 2 step | k = 1 / target | k = 2 / target |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['form']} | {r['ms'][0]:.1f} ms | {r['ms'][1]:.1f} ms | {r['ms'][2]:.1f} ms | "
              f"{r['k1_in_target_steps']:.2f} | {r['k2_in_target_steps']:.2f} |")
    if chosen:
        print("probed:", ", ".join(f"{k}: {v}" for k, v in chosen.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
