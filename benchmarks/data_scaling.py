"""The data-scaling curve: the same head and epochs trained on nested subsets of one regenerated dataset, each
judged by one greedy pass at k = 3 over the test prompt sets (untimed; its output checked against the target
alone's, decoded once for every size), the largest also timed against the target.

    .venv/bin/python benchmarks/data_scaling.py --recipe smollm2-135m-chat --sizes 300 600 1200 2400
    .venv/bin/python benchmarks/data_scaling.py --full runs/smollm2-135m-chat --sizes 300 600 1200 all
    .venv/bin/python benchmarks/data_scaling.py --recipe smollm2-135m-chat --table    # the table and plot only

1. `mtp-train prepare` of the recipe in --full (default BASE/full; regenerated once, resumable; a run the
   pipeline made is up to date).
2. For each size n (smallest first): BASE/n<n>/data holds the first n training rows of a seeded permutation of the
   full train split (so the sizes nest) and the full val split, with a manifest naming the subset and the sha256
   of its token ids; then `precompute` (with a store), `train` (train.steps = epochs x n / micro_batch, so every
   size trains the same epochs; eval once an epoch) and `test` at k = 3 with `validate.test_speed=false`; the
   largest size also runs `test` timed, at the recipe's setting (validate.test_k / test_tree, chosen on dev).
   The size `all` (every row) is the recipe's own run in --full, trained as the recipe trains it (its steps are
   the same epochs). A test of the same head and settings already in the run's validation/test_runs.jsonl is
   reused, not run again.
3. Each size's JSON goes to benchmarks/results/data-scaling-<recipe>-n<n>.json as it finishes (data hash,
   processor, tokens and wall-clock per stage, τ(3) with its interval and acceptance by position per test set);
   a later run skips a size whose JSON holds the same data hash. Then a table, the slope (τ(3) per doubling of
   the data, least squares over log2 n) and benchmarks/results/data-scaling-<recipe>.png.

Exits non-zero when a stage fails or a size's data hash differs from its JSON's (rerun with --redo N).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from mtp_train.config import compose  # noqa: E402
from mtp_train.data.chat import Tokenized  # noqa: E402
from mtp_train.data.prepare import token_ids_sha256  # noqa: E402
from mtp_train.validate.decoding import processor_name  # noqa: E402


def mtp(stage: str, recipe: str, run_dir: Path, *overrides: str) -> float:
    """One `mtp-train` stage in a subprocess; its wall-clock seconds. A failure stops the benchmark."""
    cmd = [sys.executable, "-m", "mtp_train", stage, f"recipe={recipe}", f"run_dir={run_dir}", *overrides]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        sys.exit(f"{Path(sys.argv[0]).stem}: `{' '.join(cmd[2:])}` failed")
    return time.perf_counter() - t0


def permutation(rows: int, seed: int) -> list[int]:
    """The seeded order the subsets take rows in: the first n of it make size n, so the sizes nest."""
    order = list(range(rows))
    random.Random(f"scaling:{seed}").shuffle(order)
    return order


def rows_for_tokens(full: Path, tokens: int, seed: int) -> int:
    """The fewest rows of the seeded permutation of full/train whose tokens reach `tokens` (the same training tokens
    for datasets whose rows differ in length); exits when all of them fall short."""
    import datasets

    lengths = [len(r) for r in datasets.load_from_disk(str(full / "train"))["input_ids"]]
    total = 0
    for n, i in enumerate(permutation(len(lengths), seed), 1):
        total += lengths[i]
        if total >= tokens:
            return n
    sys.exit(f"data_scaling: {full}/train holds {total:,} tokens, under the {tokens:,} asked: prepare more rows")


def subset(full: Path, n: int, seed: int):
    """The first n rows of the seeded permutation of full/train (in their order there), full/val, and the sha256
    of their token ids as prepare hashes them."""
    import datasets

    train = datasets.load_from_disk(str(full / "train"))
    if n > len(train):
        sys.exit(f"data_scaling: size {n} is over the {len(train)} training rows of {full}")
    rows = train.select(sorted(permutation(len(train), seed)[:n]))
    val = datasets.load_from_disk(str(full / "val"))
    digest = token_ids_sha256({name: [Tokenized(list(r), []) for r in ds["input_ids"]]
                               for name, ds in (("train", rows), ("val", val))})
    return rows, len(train), digest


def write_subset(full: Path, out: Path, n: int, seed: int) -> dict:
    """BASE/n<n>/data: the subset (`subset`) with full/val as it is and a manifest naming it (kept when it is
    already there)."""
    rows, of_rows, digest = subset(full, n, seed)
    manifest = json.loads((full / "manifest.json").read_text())
    if (out / "manifest.json").is_file():
        earlier = json.loads((out / "manifest.json").read_text())
        if earlier.get("subset", {}).get("rows") == n and earlier.get("token_ids_sha256") == digest:
            return earlier
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rows.save_to_disk(str(out / "train"))
    shutil.copytree(full / "val", out / "val")
    tokens = sum(len(r) for r in rows["input_ids"])
    manifest["config_hash"] = hashlib.sha256(f"{manifest['config_hash']}:{n}:{seed}".encode()).hexdigest()
    manifest["splits"]["train"] = {"samples": n, "tokens": tokens,
                                   "masked_tokens": sum(sum(m) for m in rows["loss_mask"])}
    manifest["subset"] = {"of": str(full), "rows": n, "of_rows": of_rows, "seed": seed,
                          "of_token_ids_sha256": manifest.get("token_ids_sha256")}
    manifest["token_ids_sha256"] = digest  # prepare's hash, of the subset's train and val
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def size_run(args, n: int, full: Path, epochs: float, largest: bool) -> dict:
    tc = compose(args.recipe, [f"run_dir={full}", *args.overrides]).train
    steps = max(1, round(epochs * n / (tc.micro_batch * tc.grad_accum)))  # one process
    per_epoch = max(1, round(n / (tc.micro_batch * tc.grad_accum)))
    # every row, the recipe's steps and nothing of its training overridden: the recipe's own run in `full`
    whole = n == rows_of(full) and steps == tc.steps and all(o.startswith("validate.") for o in args.overrides)
    run_dir = full if whole else Path(args.base) / f"n{n}"
    if n in args.redo and not whole:  # from scratch: no checkpoint, store or test of another run to reuse
        for d in ("checkpoints", "store"):
            shutil.rmtree(run_dir / d, ignore_errors=True)
        for f in ("metrics.jsonl", "validation/test_runs.jsonl"):
            (run_dir / f).unlink(missing_ok=True)
    # the size `all` redone: its tests only (the recipe's head, its export and its dev report stay as they are)
    args.retest = n in args.redo and whole
    manifest = subset_manifest(full, n, args.seed) if whole else write_subset(full / "data", run_dir / "data", n,
                                                                                 args.seed)
    cfg = compose(args.recipe, [f"run_dir={run_dir}", *args.overrides])
    train = ["resume=true"] if whole else [
        f"train.steps={steps}", f"train.eval_every={per_epoch}", f"train.save_every={per_epoch}",
        f"train.warmup_steps={min(cfg.train.warmup_steps, max(1, steps // 10))}", "resume=true"]
    seconds = {}
    if cfg.train.features == "store":
        seconds["precompute"] = mtp("precompute", args.recipe, run_dir, *args.overrides)
    seconds["train"] = mtp("train", args.recipe, run_dir, *args.overrides, *train)
    test = ["validate.test_k=3", *([f"validate.test_num_prompts={args.test_prompts}"] if args.test_prompts is not None
                                    else []), *args.overrides]
    # the chain of k = 3, whatever tree the recipe chose for its timed test
    seconds["test_untimed"], untimed = test_report(args, run_dir, [*test, "validate.test_tree=",
                                                                   "validate.test_speed=false"])
    timed = None
    if largest and not args.no_speed:  # timed at the recipe's setting (validate.test_k / test_tree, chosen on dev)
        seconds["test_timed"], timed = test_report(args, run_dir, test[1:])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed_steps = [m["time"] for m in metrics if "train/tokens" in m]
    # the training's own span (first to last logged step), whether it ran here or earlier (the size `all`)
    seconds["train_logged"] = timed_steps[-1] - timed_steps[0] if len(timed_steps) > 1 else None
    return {"recipe": args.recipe, "size": n, "epochs": epochs, "steps": steps, "overrides": args.overrides,
            "data": {**manifest["subset"], "token_ids_sha256": manifest["token_ids_sha256"]},
            "train_tokens": manifest["splits"]["train"]["tokens"],
            "processor": processor_name(), "threads": os.cpu_count(), "seconds": seconds, "whole_run": whole,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "sets": {s["name"]: {"tau3": s["tau"], "acceptance_by_position": s["acceptance_by_position"],
                                 "num_prompts": s["num_prompts"],
                                 "greedy_identical_prompts": s["greedy_identical_prompts"]} for s in untimed["sets"]},
            "timed": None if timed is None else {s["name"]: {k: s[k] for k in ("tau", "speedup", "implied_tau",
                                                                              "greedy_identical_prompts", "num_prompts")}
                                                 for s in timed["sets"]},
            "untimed_setting": untimed["setting"], "timed_setting": timed and timed["setting"],
            "choice": untimed["choice"],
            "val_per_epoch": [m for m in metrics if any(k.startswith("val") for k in m)]}


def rows_of(full: Path) -> int:
    return json.loads((full / "data" / "manifest.json").read_text())["splits"]["train"]["samples"]


def subset_manifest(full: Path, n: int, seed: int) -> dict:
    """The whole dataset as the largest 'subset': `full`'s own manifest, its rows in prepare's order."""
    manifest = json.loads((full / "data" / "manifest.json").read_text())
    return {**manifest, "subset": {"of": str(full), "rows": n, "of_rows": n, "seed": seed,
                                   "of_token_ids_sha256": manifest.get("token_ids_sha256")}}


def test_report(args, run_dir: Path, overrides: list[str]) -> tuple[float | None, dict]:
    """`mtp-train test` with `overrides`, or the run's recorded test of the same head (its weights' sha256) and
    settings, passed, when one is in validation/test_runs.jsonl (every test run is kept there): -> (seconds, or
    None when reused; the report)."""
    from mtp_train.files import sha256_file
    from mtp_train.model.checkpoint import trained_head

    cfg = compose(args.recipe, [f"run_dir={run_dir}", *overrides])
    runs = run_dir / "validation" / "test_runs.jsonl"
    weights = trained_head(run_dir) / "head.safetensors"
    digest = sha256_file(weights)
    keys = ("test_prompts", "test_num_prompts", "test_k", "test_tree", "test_speed", "max_new_tokens",
            "max_prompt_tokens")
    want = {k: getattr(cfg.validate, k) for k in keys}
    if runs.is_file() and not args.retest:
        for line in reversed(runs.read_text().splitlines()):
            r = json.loads(line)
            if r["head"].get("sha256", digest) != digest or {k: r["config"].get(k) for k in keys} != want or \
                    r["settings"].get("processor") != processor_name() or failures(r):
                continue
            if "sha256" not in r["head"] and (Path(r["head"]["checkpoint"]).resolve() != weights.parent.resolve()
                                               or runs.stat().st_mtime < weights.stat().st_mtime):
                continue  # a record from before heads were hashed: only when nothing was trained since
            print(f"data_scaling: reusing the test of {run_dir} recorded in {runs} (the same head and settings, "
                  f"commit {str(r['choice']['commit'])[:10]})")
            return None, r
    seconds = mtp("test", args.recipe, run_dir, *overrides)
    return seconds, json.loads((run_dir / "validation" / "test.json").read_text())


def failures(report: dict) -> list[str]:
    """What made a test run fail: its own record, or for a record from before it kept one, testset's rule applied
    to its sets (a set without greedy_identical_prompts was never checked)."""
    from mtp_train.validate.testset import set_failures

    if "failures" in report:
        return report["failures"]
    return [f for s in report["sets"] for f in set_failures(s)] + [
        f"{s['name']}: greedy identity not checked" for s in report["sets"] if "greedy_identical_prompts" not in s]


def fit(points: list[tuple[int, float]]) -> tuple[float, float, float] | None:
    """The least-squares line of the points over log2 n: (its slope, τ per doubling of the data; the mean log2 n;
    the mean value), or None for one point."""
    if len(points) < 2:
        return None
    xs, ys = [math.log2(n) for n, _ in points], [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), mx, my


# issue 55's goals on the test sets (τ(3) per set, None: the others; first-position acceptance), for the
# extrapolation the table prints
GOAL_TAU3, GOAL_ACC1 = {"functions-test": 1.9, None: 2.0}, 0.55


def reach(line: tuple[float, float, float], goal: float) -> str:
    """The data size at which the line (`fit`) reaches `goal` (an extrapolation)."""
    per_doubling, mx, my = line
    if my >= goal:
        return "the sizes measured"
    if per_doubling <= 0:
        return "no size (the line does not rise)"
    return f"~{2 ** (mx + (goal - my) / per_doubling):,.0f}"


def table(recipe: str) -> None:
    runs = sorted((json.loads(p.read_text()) for p in RESULTS.glob(f"data-scaling-{recipe}-n*.json")),
                  key=lambda r: r["size"])
    if not runs:
        print(f"no data-scaling-{recipe}-n*.json in {RESULTS}")
        return
    names = list(runs[-1]["sets"])
    print(f"| conversations | train tokens | " + " | ".join(f"{n} τ(3) [95%]" for n in names)
          + " | processor |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for r in runs:
        cells = [f"{r['sets'][n]['tau3']['value']:.3f} [{r['sets'][n]['tau3']['low']:.2f}, "
                 f"{r['sets'][n]['tau3']['high']:.2f}]" if n in r["sets"] else "" for n in names]
        print(f"| {r['size']:,} | {r['train_tokens']:,} | " + " | ".join(cells)
              + f" | {r['processor']} |")
    print(f"\n| conversations | " + " | ".join(f"{n} acceptance by position" for n in names)
          + " | precompute min | train min | untimed test min |")
    print("|---|" + "---|" * len(names) + "---|---|---|")
    for r in runs:
        cells = [" ".join(f"{a:.3f}" for a in r["sets"][n]["acceptance_by_position"]) if n in r["sets"] else ""
                 for n in names]
        # None, or the size `all`'s precompute (its store made by the pipeline): done by an earlier run
        mins = ["earlier" if not r["seconds"].get(k) or (k == "precompute" and r.get("whole_run"))
                else f"{r['seconds'][k] / 60:.1f}" for k in ("precompute", "train_logged", "test_untimed")]
        print(f"| {r['size']:,} | " + " | ".join(cells) + " | " + " | ".join(mins) + " |")
    print()
    for n in names:
        goal = GOAL_TAU3.get(n, GOAL_TAU3[None])
        pts = [(r["size"], r["sets"][n]["tau3"]["value"]) for r in runs if n in r["sets"]]
        acc = [(r["size"], r["sets"][n]["acceptance_by_position"][0]) for r in runs if n in r["sets"]]
        s, a = fit(pts), fit(acc)
        if s is None:
            print(f"{n}: one size")
            continue
        print(f"{n}: τ(3) {s[0]:+.3f} and first-position acceptance {a[0]:+.3f} per doubling of the data; on these lines "
              f"(an extrapolation) τ(3) {goal} at {reach(s, goal)} and acceptance {GOAL_ACC1} at "
              f"{reach(a, GOAL_ACC1)} conversations")
    if runs[-1].get("timed"):
        for n, s in runs[-1]["timed"].items():
            print(f"largest size, {n}: speed-up {s['speedup']['value']:.2f}x [{s['speedup']['low']:.2f}, "
                  f"{s['speedup']['high']:.2f}], τ {s['tau']['value']:.2f} at {runs[-1]['timed_setting']}, greedy identical "
                  f"{s['greedy_identical_prompts']}/{s['num_prompts']}")
    plot(recipe, runs, names)


def plot(recipe: str, runs: list[dict], names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        pts = [(r["size"], r["sets"][n]["tau3"]) for r in runs if n in r["sets"]]
        ax.errorbar([p[0] for p in pts], [p[1]["value"] for p in pts],
                    yerr=[[p[1]["value"] - p[1]["low"] for p in pts], [p[1]["high"] - p[1]["value"] for p in pts]],
                    marker="o", capsize=3, label=n)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training conversations (nested subsets)")
    ax.set_ylabel("greedy τ(3) on the test set (95%)")
    ax.set_title(f"{recipe}: what more data buys ({runs[-1]['processor']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = RESULTS / f"data-scaling-{recipe}.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2-135m-chat")
    ap.add_argument("--sizes", nargs="+", default=["300", "600", "1200", "2400"],
                    help="training conversations per size; `all`: every row, the recipe's own run in --full")
    ap.add_argument("--base", default="runs/scaling")
    ap.add_argument("--full", default=None, help="the recipe's prepared run the subsets are cut from (default: "
                    "BASE/full, prepared here); e.g. the run `mtp-train pipeline` made, whose head is then the size "
                    "`all`")
    ap.add_argument("--epochs", type=float, default=0, help="0: the recipe's (train.steps x micro_batch / rows)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-prompts", type=int, default=None,
                    help="validate.test_num_prompts (default: the recipe's; 0: every test prompt)")
    ap.add_argument("--no-speed", action="store_true", help="no timed test at the largest size")
    ap.add_argument("--redo", nargs="*", default=[], help="sizes to run again whatever their JSON says")
    ap.add_argument("--table", action="store_true", help="only the table and the plot from the JSONs")
    ap.add_argument("overrides", nargs="*", help="key=value for every stage")
    args = ap.parse_args()
    if args.table:
        table(args.recipe)
        return 0
    full = Path(args.full or Path(args.base) / "full")
    seconds = mtp("prepare", args.recipe, full, *args.overrides)
    rows = rows_of(full)
    try:
        args.sizes = [rows if n == "all" else int(n) for n in args.sizes]
        args.redo = [rows if n == "all" else int(n) for n in args.redo]
    except ValueError as e:
        sys.exit(f"data_scaling: --sizes and --redo take numbers of conversations or `all` ({e})")
    cfg = compose(args.recipe, [f"run_dir={full}", *args.overrides])
    epochs = args.epochs or cfg.train.steps * cfg.train.micro_batch * cfg.train.grad_accum / rows
    print(f"data_scaling: {rows} training rows in {full} (prepare {seconds:.0f} s), {epochs:.2f} epochs at every size")
    if over := [n for n in args.sizes if n > rows]:
        sys.exit(f"data_scaling: sizes {over} are over the {rows} training rows of {full}: ask for smaller sizes, or "
                 "more data from the recipe")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for n in sorted(args.sizes):
        out = RESULTS / f"data-scaling-{args.recipe}-n{n}.json"
        if out.is_file() and n not in args.redo:
            done = json.loads(out.read_text())
            digest = subset_manifest(full, n, args.seed)["token_ids_sha256"] if n == rows else \
                subset(full / "data", n, args.seed)[2]
            if done["data"]["token_ids_sha256"] != digest:
                sys.exit(f"data_scaling: {out} was made from other data (sha256 {done['data']['token_ids_sha256'][:12]} "
                         f"against {digest[:12]} now): rerun with --redo {n}")
            if (done["epochs"], done.get("overrides")) != (epochs, args.overrides):
                sys.exit(f"data_scaling: {out} was trained {done['epochs']:.2f} epochs with {done.get('overrides')}, "
                         f"this run asks {epochs:.2f} with {args.overrides}: rerun with --redo {n}, or the same")
            print(f"data_scaling: size {n} done ({out.name})")
            continue
        result = size_run(args, n, full, epochs, n == max(args.sizes))
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"data_scaling: wrote {out}")
    table(args.recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
