"""The peers, judged fairly (docs/peers.md, "Protocol"): every trainer, ours, speculators 0.9.0 and SpecForge 0.2.0,
gets the same budget on the 1,200-conversation subset of the broad SmolLM2 data: the 4 configurations of its grid
(`grid.yaml`, fixed before any head was trained) x seed 0, judged by vLLM on the dev sets; its best configuration
(the grid's rule) x seeds 1 and 2; those 3 seeds judged on the test sets; the table from the heads' JSONs.

    .venv/bin/python benchmarks/peers/protocol.py --stage dev [--only ours speculators specforge] [--max-heads N]
    .venv/bin/python benchmarks/peers/protocol.py --stage best
    .venv/bin/python benchmarks/peers/protocol.py --stage test
    .venv/bin/python benchmarks/peers/protocol.py --table
    .venv/bin/python benchmarks/peers/protocol.py --stage speed   (the trainers' tokens/s: speed.py)

Each stage first makes the data (each step skipped when up to date): the recipe prepared whole (the grid's
`data.full`), the subset (data_scaling.py's write_subset), its store with the pre-norm final state, the peers'
formats (write.py), and the check that no dev or test prompt overlaps the training data. Then head by head: trained
(side_by_side.py's ours / speculators / specforge with the grid's settings), its optimizer steps and real tokens per
step checked against the budget, judged (judge.py). Its JSON, benchmarks/results/peers-protocol/<trainer>-<config>-
s<seed>.json, is written when it is trained and again when it is judged. A later run skips a head whose JSON holds
the data's hash and the grid's configuration; a head of other data is trained again, or with --leave-out left out
and named.

Exits non-zero, naming the head, on a step count other than asked, real tokens per step outside the budget, greedy
output that differs from vLLM's target alone beyond a near-tie, and (--table) heads of other data or another
processor beside the table's (--leave-out: left out and named).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for path in (ROOT, HERE, HERE.parent):
    sys.path.insert(0, str(path))

GRID = HERE / "grid.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "peers-protocol"
TRAINERS = ("ours", "speculators", "specforge")
PEERS = TRAINERS[1:]
TIE = 1e-9  # mean dev τ(5) this close is a tie: the configuration listed first in the grid wins


class ProtocolError(RuntimeError):
    """Stops the benchmark with exit 1; the message names the head and what to do."""


# -- the grid and the budget --------------------------------------------------------------------------------------
def load_grid(path: Path = GRID) -> dict:
    """The grid file, checked: its sections, and 4 configurations of distinct names per trainer, each with its
    reason and schedule floor."""
    import yaml

    grid = yaml.safe_load(Path(path).read_text())
    for key in ("data", "budget", "seeds", "judge", "trainers", "speed"):
        if key not in (grid or {}):
            raise ProtocolError(f"{path}: no `{key}:` section")
    for trainer in TRAINERS:
        configs = (grid["trainers"].get(trainer) or {}).get("configs") or []
        names = [c.get("name") for c in configs]
        if len(configs) != 4 or len(set(names)) != 4:
            raise ProtocolError(f"{path}: trainers.{trainer}.configs names {names}: expected 4 configurations with "
                                "distinct names")
        for c in configs:
            if missing := [k for k in ("name", "reason", "floor") if c.get(k) in (None, "")]:
                raise ProtocolError(f"{path}: trainers.{trainer}.configs {c.get('name')!r}: give its "
                                    f"{' and '.join(missing)}")
    return grid


def configuration(grid: dict, trainer: str, name: str) -> dict:
    """What a head's training is: its configuration's settings and the budget's steps and micro-batch."""
    found = [c for c in grid["trainers"][trainer]["configs"] if c["name"] == name]
    if not found:
        raise ProtocolError(f"grid: {trainer} has no configuration {name!r} (it has "
                            f"{[c['name'] for c in grid['trainers'][trainer]['configs']]})")
    c, b = found[0], grid["budget"]
    return {"name": name, "overrides": list(c.get("overrides") or []), "flags": list(c.get("flags") or []),
            "floor": c["floor"], "steps": b["steps"], "micro_batch": b["micro_batch"],
            "fixed": grid["trainers"][trainer].get("fixed") or []}  # the trainer's settings for every configuration


def head_name(trainer: str, config: str, seed: int) -> str:
    return f"{trainer}-{config}-s{seed}"


def check_budget(name: str, speed: dict, budget: dict, reference: float, log: Path | str) -> dict:
    """The head made exactly the steps asked, with real tokens per step within the budget's tolerance of
    `reference` (micro_batch x the mean train length); -> the budget's record."""
    made, asked = speed["steps"], budget["steps"]
    if made != asked:
        raise ProtocolError(f"{name}: {made} optimizer steps made, {asked} asked: see {log}")
    per_step = speed["tokens_per_step"]
    deviation = per_step / reference - 1
    if abs(deviation) > budget["tolerance"]:
        raise ProtocolError(f"{name}: {per_step:,.0f} real tokens a step, {deviation:+.1%} from the budget's "
                            f"{reference:,.0f} (micro_batch x the mean train length, within {budget['tolerance']:.0%}):"
                            f" it read other samples or other batches than the budget's; see {log}")
    return {"steps_asked": asked, "steps_made": made, "real_tokens": round(per_step * made),
            "tokens_per_step": per_step, "reference_tokens_per_step": reference, "deviation": deviation}


def packed_rows(lengths: list[int], max_len: int, seed: int, epoch: int) -> list[int]:
    """The real tokens of each row speculators packs in one epoch, replaying its sampler with one replica
    (speculators/train/distributed_batch_sampler.py, MultipackDistributedBatchSamplerV2): a permutation from
    numpy's default_rng(seed + epoch), each row the longest run of the next samples that fits max_len tokens."""
    import numpy as np

    rows, row = [], 0
    for i in np.random.default_rng(seed + epoch).permutation(np.arange(len(lengths))):
        n = min(int(lengths[i]), max_len)
        if row and row + n > max_len:
            rows.append(row)
            row = 0
        row += n
    return rows + [row] if row else rows


def speculators_rows(lengths: list[int], seed: int, steps: int, target: float) -> dict:
    """speculators' --total-seq-len for the budget: the shortest rows whose first `steps` rows hold on average at
    least `target` real tokens, and the --epochs that hold those rows (it runs every epoch asked)."""
    def trained(seq: int) -> tuple[list[int], int]:
        rows, epoch = [], 0
        while len(rows) < steps:
            rows += packed_rows(lengths, seq, seed, epoch)
            epoch += 1
        return rows[:steps], epoch

    lo, hi = int(target), int(2 * target) + max(lengths)
    while lo < hi:  # the tokens a row holds grow with its length
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if statistics.fmean(trained(mid)[0]) < target else (lo, mid)
    rows, epochs = trained(lo)
    return {"total_seq_len": lo, "epochs": epochs, "planned_tokens_per_step": statistics.fmean(rows)}


# -- resuming and choosing ----------------------------------------------------------------------------------------
def load_heads(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*-s[0-9]*.json"))}


def write_head(folder: Path, head: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{head['head']}.json").write_text(json.dumps(head, indent=1) + "\n")


def processor_kind(processor: str) -> str:
    """A processor's name as a file-name part: "AMD EPYC" -> amd-epyc, "Intel(R) Xeon(R) Processor" ->
    intel-xeon-processor."""
    kind = re.sub(r"[^a-z0-9]+", "-", processor.lower().replace("(r)", "").replace("(tm)", "")).strip("-")
    return kind or "cpu"


def held_hashes(heads: dict[str, dict]) -> str:
    """The dataset hashes the heads' JSONs hold, each with its processors and head count."""
    hashes: dict[str, list[dict]] = {}
    for h in heads.values():
        hashes.setdefault(h["dataset"]["token_ids_sha256"], []).append(h)
    return "; ".join(f"{d[:12]} ({', '.join(sorted({h['processor'] for h in hs}))}: {len(hs)} heads)"
                     for d, hs in hashes.items()) or "no head"


def check_processor(heads: dict[str, dict], processor: str, results: Path, instead: str) -> None:
    """Stops before any data is made when every head's JSON was made on another processor kind: the data this
    machine regenerates is another dataset, so no head of theirs could be reused (`instead`: what to do)."""
    kinds = sorted({h["processor"] for h in heads.values()})
    if kinds and processor not in kinds:
        raise ProtocolError(f"the heads' JSONs in {results} were made on {' and '.join(kinds)} (data "
                            f"{held_hashes(heads)}); this machine is {processor}, whose regenerated data is another "
                            f"dataset: {instead}")


def head_state(head: dict | None, digest: str, conf: dict, role: str) -> str:
    """What a head's JSON leaves to do: `other data` (trained on data of another hash), `train` (no JSON, another
    configuration, or its export gone), `judge` (no figures of `role` yet, or judging failed) or `done`."""
    if head is None:
        return "train"
    if head["dataset"]["token_ids_sha256"] != digest:
        return "other data"
    if head.get("configuration") != conf:
        return "train"
    if head.get(role) and (head.get("error") or {}).get("role") != role:
        return "done"  # its figures are in the JSON: the export (under runs/, not committed) is not needed again
    return "judge" if Path(head["export"]).is_dir() else "train"  # judging needs the export: a fresh clone retrains


def mean_dev_tau(head: dict) -> float:
    return statistics.fmean(s["tau"] for s in head["dev"]["sets"].values())


def best_config(heads: dict[str, dict], grid: dict, trainer: str) -> str:
    """The grid's rule: the configuration whose seed-0 head has the highest mean over the dev sets of τ(5); a tie
    (within TIE) goes to the configuration listed first in the grid."""
    seed = grid["seeds"]["dev"][0]
    scores = {}
    for c in grid["trainers"][trainer]["configs"]:
        head = heads.get(head_name(trainer, c["name"], seed))
        if not head or not head.get("dev") or head.get("error"):
            raise ProtocolError(f"{head_name(trainer, c['name'], seed)}: no dev figures on this data"
                                + (f" (it failed: {head['error']['what']})" if head and head.get("error") else "")
                                + ": run --stage dev first")
        scores[c["name"]] = mean_dev_tau(head)
    top = max(scores.values())
    return next(name for name, score in scores.items() if score >= top - TIE)


# -- the data, training and judging (the slow parts) ------------------------------------------------------------------
def subset_data(grid: dict, work: Path) -> dict:
    """The recipe prepared whole (skipped when up to date) and the subset cut from it in work/base/data; -> the
    subset's manifest (its `token_ids_sha256`: the data's hash), before any store is made."""
    from data_scaling import mtp, write_subset

    d = grid["data"]
    full = ROOT / d["full"]
    mtp("prepare", d["recipe"], full)
    return write_subset(full / "data", work / "base" / "data", d["rows"], d["seed"])


def prepare(grid: dict, work: Path) -> SimpleNamespace:
    """The data every head of this run reads, made or found up to date; -> what training and judging need."""
    import datasets

    import side_by_side as sbs
    from data_scaling import mtp
    from mtp_train.config import compose
    from mtp_train.inference.vllm_engine import find_vllm_python
    from mtp_train.model.target import load_tokenizer
    from mtp_train.validate.disjoint import check_disjoint
    from mtp_train.validate.run import prompt_sets
    from write import write

    d, j = grid["data"], grid["judge"]
    base = work / "base"
    manifest = subset_data(grid, work)
    digest = manifest["token_ids_sha256"]
    layers = sbs.target_layers(d["recipe"], base)
    common = [f"store.layers=[{layers}]", "target.device=cpu"]
    mtp("precompute", d["recipe"], base, *common, "store.overwrite=true")
    cfg = compose(d["recipe"], [f"run_dir={base}", *common, f"validate.num_prompts={j['dev_prompts']}",
                                f"validate.test_num_prompts={j['test_prompts']}",
                                f"validate.max_new_tokens={j['new_tokens']}"])
    heads_dir = work / digest[:12]
    peers_json = heads_dir / "data" / "peers.json"
    if not peers_json.is_file():
        write(cfg, heads_dir / "data")
    peers = json.loads(peers_json.read_text())
    lengths = datasets.load_from_disk(peers["speculators"]["dir"])["seq_len"][:peers["samples"]["train"]]
    tokenizer = load_tokenizer(cfg.target.path)
    sets = {role: prompt_sets(cfg.validate, base / "data", tokenizer, role) for role in ("dev", "test")}
    check_disjoint(base / "data", tokenizer, sets["dev"], sets["test"])
    python = find_vllm_python()
    if python is None:
        raise ProtocolError("vLLM judges every head: build .venv-vllm (make test-serving) or set "
                            "$MTP_TRAIN_VLLM_PYTHON")
    return SimpleNamespace(grid=grid, cfg=cfg, base=base, work=heads_dir, hash=digest, layers=layers, peers=peers,
                           peers_json=peers_json, lengths=[int(n) for n in lengths], sets=sets, python=python,
                           reference=grid["budget"]["micro_batch"] * peers["mean_train_length"],
                           dataset={"token_ids_sha256": digest, "rows": d["rows"], "path": str(base / "data"),
                                    "of_token_ids_sha256": manifest["subset"]["of_token_ids_sha256"]})


def train_head(ctx: SimpleNamespace, trainer: str, conf: dict, seed: int) -> dict:
    """One head trained by its trainer (side_by_side.py's launchers) -> its export, speed record and settings."""
    import side_by_side as sbs

    name, b = head_name(trainer, conf["name"], seed), ctx.grid["budget"]
    args = SimpleNamespace(recipe=ctx.grid["data"]["recipe"], base=ctx.base, reuse=True, depth=ctx.cfg.train.depth,
                           steps=b["steps"], micro_batch=b["micro_batch"], seed=seed, peer_layers=1, mask_token_id=2)
    stamp, t0, extra = ctx.work / name / "protocol-train.json", time.perf_counter(), {}
    try:
        if trainer == "ours":
            fixed = [f["override"] for f in ctx.grid["trainers"]["ours"].get("fixed") or []]
            h = sbs.ours(args, [f"store.layers=[{ctx.layers}]", "target.device=cpu", f"train.steps={b['steps']}",
                                f"train.micro_batch={b['micro_batch']}", f"train.seed={seed}", *fixed,
                                *conf["overrides"]], name, ctx.work)
            if h["export"] is None:
                raise ProtocolError(f"{name}: not exported ({h['not_exported']}): vLLM cannot serve it")
            extra = {"layers": h["cfg"].head.num_layers, "teacher_forced": h["teacher_forced"]}
        elif trainer == "speculators":
            extra = speculators_rows(ctx.lengths, seed, b["steps"], ctx.reference)
            h = sbs.speculators(args, ctx.peers, ctx.work, name, settings=conf["flags"], seq=extra["total_seq_len"],
                                epochs=extra["epochs"])
        else:
            h = sbs.specforge(args, ctx.peers_json, ctx.work, name, settings=conf["flags"], overrides=conf["overrides"])
        if trainer != "ours":  # a peer's launcher's run-time adjustments and how often each ran (None: a setting)
            extra.update(layers=1, adjustments={k: v["calls"] for k, v in h["adjustments"].items()})
    except RuntimeError as e:  # a launcher's failure or a step count other than asked
        raise ProtocolError(f"{name}: {e}") from None
    settings, seconds = h.get("settings") or h["overrides"], time.perf_counter() - t0
    if stamp.is_file() and json.loads(stamp.read_text())["settings"] == settings:
        seconds = json.loads(stamp.read_text())["seconds"]  # trained by an earlier run, reused by the launcher
    else:
        stamp.write_text(json.dumps({"settings": settings, "seconds": seconds}))
    return {"export": str(h["export"]), "speed": h["speed"], "settings": settings, "train_seconds": seconds,
            "log": str(ctx.work / name / ("metrics.jsonl" if trainer == "ours" else "log.txt")), **extra}


def judge_head(ctx: SimpleNamespace, head: dict, role: str) -> tuple[dict, list[str]]:
    """vLLM's figures of one head on the `role` sets, and the greedy mismatches that are no near-tie."""
    from judge import judge, near_ties

    j = ctx.grid["judge"]
    try:
        figures = judge(Path(head["export"]), ctx.sets[role], ctx.work / head["head"] / f"judge-{role}", ctx.python,
                        ctx.cfg.target.path, j["k"], j["new_tokens"], ctx.work / "judge")
    except RuntimeError as e:
        raise ProtocolError(f"{head['head']}: {e}") from None
    figures["mean_tau"] = statistics.fmean(s["tau"] for s in figures["sets"].values())
    return figures, near_ties(figures["sets"], ctx.sets[role], ctx.cfg)


# -- the stages -------------------------------------------------------------------------------------------------------
def run_heads(ctx: SimpleNamespace, heads: dict, wanted: list[tuple[str, str, int]], role: str, args) -> None:
    """Train (when its JSON asks for it) and judge on the `role` sets each (trainer, configuration, seed)."""
    import torch

    from mtp_train.validate.testset import choice_record
    from timing import machine

    trained = 0
    for trainer, config, seed in wanted:
        name, conf = head_name(trainer, config, seed), configuration(ctx.grid, trainer, config)
        state = head_state(heads.get(name), ctx.hash, conf, role)
        if state == "done":
            print(f"protocol: {name} has its {role} figures ({args.results / name}.json)")
            continue
        if state == "other data" and args.leave_out:
            print(f"protocol: {name} left out: trained on other data "
                  f"({heads[name]['dataset']['token_ids_sha256'][:12]})")
            continue
        if state in ("train", "other data"):
            if args.max_heads is not None and trained >= args.max_heads:
                print(f"protocol: stopping before {name}: --max-heads {args.max_heads} trained")
                return
            print(f"protocol: training {name}" + (" (its JSON is of other data)" if state == "other data" else ""))
            t = train_head(ctx, trainer, conf, seed)
            trained += 1
            old = heads.get(name) if state == "train" else None  # same data and configuration: its export was gone
            kept = {r: old.get(r) for r in ("dev", "test")} if old and old.get("configuration") == conf else {}
            reason = next(c["reason"] for c in ctx.grid["trainers"][trainer]["configs"] if c["name"] == config)
            heads[name] = {"head": name, "trainer": trainer, "configuration": conf, "reason": reason, "seed": seed,
                           "budget": check_budget(name, t["speed"], ctx.grid["budget"], ctx.reference, t["log"]),
                           "dataset": ctx.dataset, "processor": this_processor(),
                           "machine": machine(torch.get_num_threads()), "git": {
                               k: v for k, v in choice_record(ROOT).items() if k in ("commit", "dirty")},
                           "grid_sha256": sha256(args.grid),
                           "date": time.strftime("%Y-%m-%d %H:%M"), **t, "dev": None, "test": None}
            for r, figures in kept.items():  # trained again from the same data, configuration and seed (its
                if figures:  # figures stay: on one processor a training is deterministic), named as such
                    heads[name][r] = {**figures, "judged_before_retraining": True}
            if t["train_seconds"] > 60 * ctx.grid["budget"]["max_train_minutes"]:
                print(f"protocol: {name} trained {t['train_seconds'] / 60:.1f} min, over the budget's "
                      f"{ctx.grid['budget']['max_train_minutes']}")
            write_head(args.results, heads[name])
        head = heads[name]
        # a best seed the test stage trains before the best stage did: its dev figures too (the spread over seeds),
        # from the same export, so that it is not trained twice
        for r in (["dev"] if role == "test" and not head.get("dev") else []) + [role]:
            judge_role(ctx, head, r, args.results)


def judge_role(ctx: SimpleNamespace, head: dict, role: str, results: Path) -> None:
    """One head judged on the `role` sets, its JSON written; stops on greedy output beyond a near-tie."""
    name = head["head"]
    print(f"protocol: judging {name} on the {role} sets")
    head[role], problems = judge_head(ctx, head, role)
    if (head.get("error") or {}).get("role") == role:
        del head["error"]  # judged again, and passed
    if problems:
        head["error"] = {"role": role, "what": "greedy output differs from vLLM's target alone beyond a "
                                              f"near-tie ({role}): " + "; ".join(problems[:3])}
    write_head(results, head)
    if problems:
        raise ProtocolError(f"{name}: {head['error']['what']} ({results / name}.json)")
    print(f"protocol: {name}: mean {role} τ({ctx.grid['judge']['k']}) {head[role]['mean_tau']:.3f}")


def wanted_heads(grid: dict, heads: dict, digest: str, stage: str, only: list[str]) -> list[tuple[str, str, int]]:
    """The (trainer, configuration, seed) of a stage: dev, every configuration's dev seed; best, the best
    configuration's further seeds; test, all seeds of the best configuration."""
    seeds = grid["seeds"]
    if stage == "dev":
        return [(t, c["name"], s) for t in only for c in grid["trainers"][t]["configs"] for s in seeds["dev"]]
    current = {n: h for n, h in heads.items() if h["dataset"]["token_ids_sha256"] == digest}
    runs = []
    for t in only:
        best = best_config(current, grid, t)
        print(f"protocol: {t}: best on dev {best}")
        runs += [(t, best, s) for s in (seeds["best"] if stage == "best" else [*seeds["dev"], *seeds["best"]])]
    return runs


def this_processor() -> str:
    from mtp_train.validate.decoding import processor_name

    return processor_name()


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("dev", "best", "test", "speed"))
    ap.add_argument("--table", action="store_true", help="the table from the heads' JSONs (no data, no training)")
    ap.add_argument("--only", nargs="+", choices=TRAINERS, default=list(TRAINERS), help="the trainers this run does")
    ap.add_argument("--max-heads", type=int, default=None, help="train at most N heads in this run (a session's share)")
    ap.add_argument("--leave-out", action="store_true", help="leave heads of other data out (named) instead of "
                    "training them again; --table: leave them out of the table instead of failing")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "peers-protocol")
    ap.add_argument("--grid", type=Path, default=GRID)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--chosen-on", default=None, metavar="HASH", help="--stage speed: the dataset hash (a prefix) "
                    "whose dev heads chose the configurations, when this machine's data is another (another "
                    "processor kind)")
    ap.add_argument("--hash", default=None, help="--table: the dataset hash of the table (default: most heads')")
    args = ap.parse_args(argv)
    if not args.stage and not args.table:
        ap.error("give --stage dev|best|test or --table")
    try:
        grid = load_grid(args.grid)
        if args.stage == "speed":
            import torch

            from speed import run_speed

            os.environ.setdefault("WANDB_MODE", "offline")
            torch.set_num_threads(min(2, os.cpu_count() or 1))
            return run_speed(grid, args, prepare)
        if args.stage:
            import torch

            os.environ.setdefault("WANDB_MODE", "offline")
            torch.set_num_threads(min(2, os.cpu_count() or 1))
            heads = load_heads(args.results)
            check_processor(heads, this_processor(), args.results,
                            "none of theirs can be reused here (each would be trained again over its JSON, or "
                            "with --leave-out left out). Run this stage on their processor kind, or give --results "
                            "DIR for a table of this one")
            ctx = prepare(grid, args.work.resolve())
            role = "test" if args.stage == "test" else "dev"  # the best configuration's seeds are judged on dev too
            run_heads(ctx, heads, wanted_heads(grid, heads, ctx.hash, args.stage, args.only), role, args)
        if args.table:
            from table import print_table

            return print_table(grid, args)
    except ProtocolError as e:
        print(f"protocol: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    import protocol  # run as the module table.py imports, so that one ProtocolError class serves both

    sys.exit(protocol.main())
