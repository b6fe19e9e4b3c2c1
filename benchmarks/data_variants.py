"""The dev experiments that choose how the broad recipe's data is made (issue 55): first turns or every turn,
replies written in bf16 or fp32, prompts the target writes itself. benchmarks/data_variants.yaml fixes the
variants, their scale, the dev sets and the rule before anything is trained.

    .venv/bin/python benchmarks/data_variants.py                       # every variant (resumes from the JSONs)
    .venv/bin/python benchmarks/data_variants.py --only first-bf16 first-fp32
    .venv/bin/python benchmarks/data_variants.py --table               # the table and the verdicts only

For each variant, in BASE/<name>:
1. `full/`: `mtp-train prepare` of the recipe with the variant's sources (regenerated and decontaminated as the
   recipe does; the regeneration cache makes a rerun cheap).
2. `cut/`: the reference variant's rows whole, every other variant cut to the reference's training tokens (the
   fewest rows of data_scaling.py's seeded permutation that reach them; a variant short of them by more than 2%
   stops the run), then `precompute` and `train` for the same epochs (steps from the rows, eval and a checkpoint
   each epoch, warm-up scaled as data_scaling.py does).
3. The dev pass: the head's greedy chain of k drafts over the dev sets (the same prompts for every variant),
   untimed, its output checked against the target alone's (testset.py's untimed pass, the target decoded once for
   all variants); the dev prompts are checked against the variant's training rows first (an overlap stops it).
4. benchmarks/results/data-variants/<recipe>-<name>.json as it finishes (data hashes, processor, regeneration
   engine and time, tokens, steps, wall-clock per stage, per set τ with its 95% interval, acceptance by position,
   greedy identity, the per-prompt counts the paired comparison needs, the per-epoch teacher-forced figures). A
   later run skips a variant whose JSON has the same definition (a fresh clone keeps the figures without the
   runs).

The table: per variant and dev set τ(k) [95%], the pooled τ over every dev prompt, its difference from the
reference with a paired 95% interval (the same prompt draws for both heads), and the verdicts of the yaml's rules.
Exits non-zero on a stage that fails, greedy output beyond an fp32 near-tie, or a JSON of another definition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from data_scaling import mtp, rows_for_tokens, write_subset  # noqa: E402
from mtp_train.config import compose  # noqa: E402
from mtp_train.validate.decoding import processor_name  # noqa: E402
from mtp_train.validate.testset import interval, ratio_draws, set_failures  # noqa: E402

GRID = ROOT / "benchmarks" / "data_variants.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "data-variants"
TOLERANCE = 0.02  # a variant may hold this share fewer tokens than the reference and still be trained whole
SEED = 0  # the bootstrap's


def flow(d: dict) -> str:
    """A source as a Hydra override's dict literal."""
    return "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"


def definition(grid: dict, v: dict) -> dict:
    """What a variant's figures depend on: its sources, overrides, the epochs, seed, dev sets and recipe."""
    sources = [{**grid["sharegpt"], **(v.get("sharegpt") or {})}, grid["functions"], *(v.get("extra") or []),
               grid["val"]]
    return {"recipe": grid["recipe"], "sources": sources, "overrides": list(v.get("overrides") or []),
            "epochs": grid["epochs"], "seed": grid["seed"], "dev": grid["dev"],
            "reference": grid["reference"]}


def stage_overrides(d: dict) -> list[str]:
    return ["data.sources=[" + ",".join(flow(s) for s in d["sources"]) + "]", *d["overrides"]]


def dev_overrides(d: dict) -> list[str]:
    dev = d["dev"]
    return ["validate.prompts=[" + ",".join(dev["prompts"]) + "]", f"validate.num_prompts={dev['num_prompts']}",
            "validate.test_speed=false", f"validate.test_k={dev['k']}", "validate.test_tree="]


def dev_pass(recipe: str, run_dir: Path, overrides: list[str]) -> tuple[dict, list[dict]]:
    """The head of run_dir on the dev sets: testset.py's untimed pass at the chain validate.test_k, after the dev
    prompts are checked against the run's training rows."""
    from mtp_train.files import sha256_file
    from mtp_train.inference.load import check_drafter, load_head, stop_tokens
    from mtp_train.inference.runner import load_runner
    from mtp_train.model.target import load_tokenizer
    from mtp_train.validate.disjoint import check_disjoint
    from mtp_train.validate.run import prompt_sets
    from mtp_train.validate.testset import test_set

    cfg = compose(recipe, [f"run_dir={run_dir}", *overrides])
    check_drafter(cfg, "head")
    tokenizer = load_tokenizer(cfg.target.path)
    sets = prompt_sets(cfg.validate, run_dir / "data", tokenizer, "dev")
    checked = check_disjoint(run_dir / "data", tokenizer, sets, [])
    target = load_runner(cfg.target.path, cfg.target)
    drafter, meta = load_head(cfg, target)
    stop = stop_tokens(tokenizer, target)
    sections = []
    for s in sets:
        print(f"data_variants: dev set {s.name}: {s.line}", flush=True)
        sections.append(test_set(cfg, target, drafter, s, stop, None))
    head = {"checkpoint": meta["checkpoint"], "step": meta["step"],
            "sha256": sha256_file(Path(meta["checkpoint"]) / "head.safetensors"), "disjoint": checked}
    return head, sections


def run_variant(grid: dict, v: dict, base: Path, ref_tokens: int | None) -> dict:
    d, recipe = definition(grid, v), grid["recipe"]
    common = stage_overrides(d)
    work = base / v["name"]
    # the benchmark's own run: a changed definition makes its data again
    seconds = {"prepare": mtp("prepare", recipe, work / "full", *common, "data.overwrite=true")}
    full = work / "full" / "data"
    manifest = json.loads((full / "manifest.json").read_text())
    rows, tokens = manifest["splits"]["train"]["samples"], manifest["splits"]["train"]["tokens"]
    if ref_tokens is None or tokens < ref_tokens:
        if ref_tokens is not None and tokens < (1 - TOLERANCE) * ref_tokens:
            sys.exit(f"data_variants: {v['name']} holds {tokens:,} training tokens, {ref_tokens - tokens:,} short of "
                     f"the reference's {ref_tokens:,} (more than {TOLERANCE:.0%}): raise its limit in {GRID.name}")
        n = rows  # the reference, or a variant within the tolerance: every row
    else:
        n = rows_for_tokens(full, ref_tokens, d["seed"])
    earlier = work / "cut" / "data" / "manifest.json"
    earlier = json.loads(earlier.read_text())["token_ids_sha256"] if earlier.is_file() else None
    cut = write_subset(full, work / "cut" / "data", n, d["seed"])
    if earlier not in (None, cut["token_ids_sha256"]):  # other data than the store and checkpoints were made from
        for stale in ("store", "checkpoints"):
            shutil.rmtree(work / "cut" / stale, ignore_errors=True)
        (work / "cut" / "metrics.jsonl").unlink(missing_ok=True)
    tc = compose(recipe, [f"run_dir={work / 'cut'}", *common]).train
    per_epoch = max(1, round(n / (tc.micro_batch * tc.grad_accum)))
    steps = max(1, round(d["epochs"] * per_epoch))
    train = [f"train.steps={steps}", f"train.eval_every={per_epoch}", f"train.save_every={per_epoch}",
             f"train.warmup_steps={min(tc.warmup_steps, max(1, steps // 10))}", "resume=true"]
    seconds["precompute"] = mtp("precompute", recipe, work / "cut", *common)
    seconds["train"] = mtp("train", recipe, work / "cut", *common, *train)
    t0 = time.perf_counter()
    head, sections = dev_pass(recipe, work / "cut", [*common, *dev_overrides(d)])
    seconds["dev_pass"] = time.perf_counter() - t0
    metrics = [json.loads(x) for x in (work / "cut" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    regen = manifest.get("regenerate") or {}
    return {"variant": v["name"], "reason": v.get("reason"), "definition": d, "head": head,
            "data": {"rows": n, "of_rows": rows, "train_tokens": cut["splits"]["train"]["tokens"], "of_tokens": tokens,
                     "reference_tokens": ref_tokens, "token_ids_sha256": cut["token_ids_sha256"],
                     "of_token_ids_sha256": manifest["token_ids_sha256"], "path": str(work / "cut" / "data"),
                     "target_prompts": manifest.get("target_prompts"),
                     "regeneration": {k: regen.get(k) for k in ("engine", "seconds", "tokens_per_s", "generated_tokens",
                                                                "turns", "turns_from_journal")}},
            "steps": steps, "processor": processor_name(), "threads": os.cpu_count(), "seconds": seconds,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "sets": {s["name"]: {k: s[k] for k in ("tau", "acceptance_by_position", "num_prompts",
                                                    "greedy_identical_prompts", "greedy_mismatches", "per_prompt")}
                     for s in sections},
            "failures": [f for s in sections for f in set_failures(s)],
            "val_per_epoch": [m for m in metrics if any(k.startswith("val") for k in m)]}


def pooled(r: dict) -> tuple[list[float], list[float]]:
    """Emitted tokens and verification steps per dev prompt, every set in the yaml's order."""
    pp = [p for name in r["definition"]["dev"]["prompts"] for p in r["sets"][name]["per_prompt"]]
    return [p["emitted"] for p in pp], [p["steps"] for p in pp]


def compare(r: dict, ref: dict) -> dict:
    """The pooled τ of r, and its difference from ref's with a paired 95% interval (ratio_draws with one seed draws
    the same prompts for both: the prompts are the same, in the same order)."""
    (num, den), (rnum, rden) = pooled(r), pooled(ref)
    if len(num) != len(rnum):
        raise SystemExit(f"data_variants: {r['variant']} was judged on {len(num)} dev prompts, the reference on "
                         f"{len(rnum)}: not the same prompts")
    mine, theirs = ratio_draws([num], [den], SEED), ratio_draws([rnum], [rden], SEED)
    diff = [a - b for a, b in zip(mine, theirs) if a is not None and b is not None]
    tau, ref_tau = sum(num) / sum(den), sum(rnum) / sum(rden)
    return {"tau": interval(tau, mine), "diff": interval(tau - ref_tau, diff)}


def table(grid: dict, results: Path = RESULTS) -> int:
    runs = {v["name"]: json.loads(p.read_text()) for v in grid["variants"]
            if (p := results / f"{grid['recipe']}-{v['name']}.json").is_file()}
    if grid["reference"] not in runs:
        print(f"no {grid['recipe']}-{grid['reference']}.json in {results}: the reference is not judged yet")
        return 0
    ref, k = runs[grid["reference"]], grid["dev"]["k"]
    names = grid["dev"]["prompts"]
    print(f"| variant | train rows | train tokens | " + " | ".join(f"{n} τ({k}) [95%]" for n in names)
          + f" | pooled τ({k}) [95%] | − reference [paired 95%] | acceptance by position (pooled) | processor |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|---|---|")
    verdicts, out = [], {}
    for name, r in runs.items():
        c = compare(r, ref)
        out[name] = c
        cells = [f"{r['sets'][n]['tau']['value']:.3f} [{r['sets'][n]['tau']['low']:.2f}, {r['sets'][n]['tau']['high']:.2f}]"
                 for n in names]
        acc = pooled_acceptance(r)
        print(f"| {name} | {r['data']['rows']:,} | {r['data']['train_tokens']:,} | " + " | ".join(cells)
              + f" | {c['tau']['value']:.3f} [{c['tau']['low']:.3f}, {c['tau']['high']:.3f}] | "
              + ("(reference)" if name == grid["reference"] else
                 f"{c['diff']['value']:+.3f} [{c['diff']['low']:+.3f}, {c['diff']['high']:+.3f}]")
              + f" | {' '.join(f'{a:.2f}' for a in acc)} | {r['processor']} |")
        if name != grid["reference"]:
            wins = c["diff"]["value"] > 0 and c["diff"]["low"] > 0
            verdicts.append(f"{name}: {'replaces' if wins else 'does not replace'} the reference "
                            f"(τ {c['diff']['value']:+.3f}, paired 95% [{c['diff']['low']:+.3f}, "
                            f"{c['diff']['high']:+.3f}])")
    if "first-fp32" in out and "first-bf16" in out:
        fp32, bf16 = out["first-fp32"]["tau"], out["first-bf16"]["tau"]["value"]
        good = bf16 >= fp32["low"]
        verdicts.append(f"bf16-written replies: τ {bf16:.3f} {'within or above' if good else 'below'} the fp32-written "
                        f"head's 95% interval [{fp32['low']:.3f}, {fp32['high']:.3f}]: "
                        f"{'good' if good else 'not good: regenerate in fp32'}")
        for name in ("first-bf16", "first-fp32"):
            g = runs[name]["data"]["regeneration"]
            if g.get("seconds"):
                verdicts.append(f"  {name}: regenerated by {g['engine']}: {g['generated_tokens']:,} tokens in "
                                f"{g['seconds']:.0f} s ({g['tokens_per_s']:.1f} tokens/s"
                                + (f", {g['turns_from_journal']} turns from the journal" if g.get("turns_from_journal")
                                   else "") + ")")
    print("\n".join(verdicts))
    bad = [f"{name}: {f}" for name, r in runs.items() for f in r["failures"]]
    for b in bad:
        print(f"data_variants: untrustworthy: {b}", file=sys.stderr)
    return 1 if bad else 0


def pooled_acceptance(r: dict) -> list[float]:
    """Acceptance by position over every dev prompt (each set's weighted by its verification steps)."""
    sets = [r["sets"][n] for n in r["definition"]["dev"]["prompts"]]
    steps = [sum(p["steps"] for p in s["per_prompt"]) for s in sets]
    return [sum(s["acceptance_by_position"][j] * w for s, w in zip(sets, steps)) / sum(steps)
            for j in range(len(sets[0]["acceptance_by_position"]))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", default=str(GRID))
    ap.add_argument("--base", default="runs/variants")
    ap.add_argument("--only", nargs="*", default=None, help="these variants (the reference is made first when needed)")
    ap.add_argument("--redo", nargs="*", default=[], help="variants to run again whatever their JSON says")
    ap.add_argument("--table", action="store_true", help="only the table and the verdicts from the JSONs")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the JSONs go")
    args = ap.parse_args()
    grid = yaml.safe_load(Path(args.grid).read_text())
    names = [v["name"] for v in grid["variants"]]
    if grid["reference"] not in names or len(set(names)) < len(names):
        sys.exit(f"data_variants: {args.grid}: distinct variant names, the reference {grid['reference']!r} among them")
    if unknown := sorted(set(args.only or []) - set(names)):
        sys.exit(f"data_variants: no variant {unknown} in {args.grid} (variants: {', '.join(names)})")
    if args.table:
        return table(grid, args.results)
    args.results.mkdir(parents=True, exist_ok=True)
    todo = [v for v in grid["variants"] if args.only is None or v["name"] in args.only or v["name"] == grid["reference"]]
    todo.sort(key=lambda v: v["name"] != grid["reference"])  # the reference first: the others take its tokens
    ref_tokens = None
    for v in todo:
        out = args.results / f"{grid['recipe']}-{v['name']}.json"
        if out.is_file() and v["name"] not in args.redo:
            done = json.loads(out.read_text())
            if done["definition"] != definition(grid, v):
                sys.exit(f"data_variants: {out} was made from another definition of {v['name']}: rerun with "
                         f"--redo {v['name']}, or put the yaml back")
            print(f"data_variants: {v['name']} done ({out.name})")
        else:
            if args.redo and v["name"] in args.redo:
                shutil.rmtree(Path(args.base) / v["name"] / "cut", ignore_errors=True)
            done = run_variant(grid, v, Path(args.base), ref_tokens)
            out.write_text(json.dumps(done, indent=1) + "\n")
            print(f"data_variants: wrote {out}")
        if v["name"] == grid["reference"]:
            ref_tokens = done["data"]["train_tokens"]
    return table(grid, args.results)


if __name__ == "__main__":
    sys.exit(main())
