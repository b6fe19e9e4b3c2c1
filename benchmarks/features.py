"""Store, online and hybrid training (`train.features`) side by side: wall-clock and disk, at 1 and 3 epochs.

For each (epochs, mode) a fresh run directory gets a copy of one prepared run's data (`--data RUN_DIR`: its
`data/`, made by `mtp-train prepare` with the same recipe), then runs, as a user would, through the CLI:

    store   mtp-train precompute + mtp-train train (train.features=store)
    online  mtp-train train train.features=online
    hybrid  mtp-train train train.features=hybrid

and records each command's wall time, the store's bytes on disk, the final val metrics, and whether the trained
head equals the store run's bit for bit (fp32 on CPU: it must). Modes are interleaved per epoch count.

    .venv/bin/python benchmarks/features.py --recipe tiny --data runs/demo [--epochs 1 3] [--set key=value ...]

Prints a table and writes benchmarks/results/features-<recipe>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import command, machine  # noqa: E402

from mtp_train.validate.decoding import processor_name  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("store", "online", "hybrid")


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def cli(stage: str, args: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        r = subprocess.run([sys.executable, "-m", "mtp_train", stage, *args], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"mtp-train {stage} failed (exit {r.returncode}); log: {log}")
    return time.perf_counter() - t0


def final_metrics(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val/d1/acc" in r][-1]
    return {k: last[k] for k in ("val/d1/acc", "val/d1/accept") if k in last}


def same_head(a: Path, b: Path) -> bool:
    import torch

    from mtp_train.train import checkpoint as ckpt

    wa, wb = ckpt.load_head_state(ckpt.latest(a / "checkpoints")), ckpt.load_head_state(ckpt.latest(b / "checkpoints"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def subset(data: Path, out: Path, limits: dict[str, int]) -> Path:
    """The first limits[split] samples of each split of prepared data, written as prepare writes data."""
    import datasets

    from mtp_train.data import prepare as prep
    from mtp_train.data.chat import Tokenized

    splits = {}
    for name in ("train", "val"):
        ds = datasets.load_from_disk(str(data / name))
        n = limits[name] or len(ds)
        splits[name] = [Tokenized(r["input_ids"], r["loss_mask"]) for r in ds.select(range(min(n, len(ds))))]
    manifest = json.loads((data / "manifest.json").read_text())
    manifest = {"tokenizer": manifest["tokenizer"], "subset_of": str(data), "limits": limits,
                "splits": {k: prep.split_stats(v) for k, v in splits.items()}}
    shutil.rmtree(out, ignore_errors=True)
    prep.write(out, splits, manifest)
    return out


def write(args, data: Path, rows: list[dict]) -> Path:
    manifest = json.loads((data / "manifest.json").read_text())
    result = {"benchmark": "features", "date": date.today().isoformat(), "machine": {**machine(int(os.environ.get(
        "OMP_NUM_THREADS", os.cpu_count() or 1))), "cpu_model": processor_name()}, "command": command("features.py", args),
        "recipe": args.recipe, "data": {k: v for k, v in manifest.get("splits", {}).items()}, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"features-{args.recipe}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--data", required=True, help="a run directory whose data/ prepare wrote for this recipe")
    p.add_argument("--epochs", type=float, nargs="+", default=[1, 3])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--train-samples", type=int, default=0, help="the first N train samples only (0: all)")
    p.add_argument("--val-samples", type=int, default=0, help="the first N val samples only (0: all)")
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every stage")
    p.add_argument("--keep", default=None, help="keep the run directories under this folder")
    args = p.parse_args()
    data = Path(args.data) / "data"
    if not (data / "manifest.json").is_file():
        raise SystemExit(f"{data}: no prepared data (run `mtp-train prepare recipe={args.recipe} run_dir={args.data}`)")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="features-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    if args.train_samples or args.val_samples:
        data = subset(data, root / "subset" / "data", {"train": args.train_samples, "val": args.val_samples})
    rows = []
    for epochs in args.epochs:
        runs = {}
        for mode in args.modes:
            run_dir = root / f"{mode}-{epochs:g}ep"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            shutil.copytree(data, run_dir / "data")
            common = [f"recipe={args.recipe}", f"run_dir={run_dir}", "train.steps=0", f"train.epochs={epochs}",
                      "train.eval_every=0", "train.save_every=0", f"train.features={mode}", *args.set]
            log = run_dir / "bench.log"
            seconds = {"precompute": cli("precompute", common, log) if mode == "store" else 0.0}
            seconds["train"] = cli("train", common, log)
            runs[mode] = run_dir
            row = {"epochs": epochs, "mode": mode, "precompute_s": round(seconds["precompute"], 1),
                   "train_s": round(seconds["train"], 1), "total_s": round(sum(seconds.values()), 1),
                   "store_bytes": disk_bytes(run_dir / "store"), "load_1min": round(os.getloadavg()[0], 2),
                   **final_metrics(run_dir)}
            if mode != "store" and "store" in runs:
                row["same_head_as_store"] = same_head(run_dir, runs["store"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(args, data, rows)  # after every row: a run cut short keeps what it measured
        if not args.keep:
            for d in runs.values():
                shutil.rmtree(d, ignore_errors=True)
    out = write(args, data, rows)
    print(f"\n{args.recipe} on {processor_name()} ({os.cpu_count()} CPUs)")
    print(f"{'epochs':>6} {'mode':<7} {'precompute s':>13} {'train s':>8} {'total s':>8} {'store MiB':>10} "
          f"{'d1 acc':>7} {'= store':>8}")
    for r in rows:
        print(f"{r['epochs']:>6g} {r['mode']:<7} {r['precompute_s']:>13.1f} {r['train_s']:>8.1f} {r['total_s']:>8.1f} "
              f"{r['store_bytes'] / 2**20:>10.2f} {r.get('val/d1/acc', float('nan')):>7.3f} "
              f"{str(r.get('same_head_as_store', '')):>8}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
