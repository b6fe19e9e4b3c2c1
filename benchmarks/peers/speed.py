"""The peers protocol's trainer speed (`protocol.py --stage speed`; issue 56, item 6): each trainer's tokens/s as it
trains the head whose test figures the table gives: each trainer, ours too, at its best configuration on dev, side
by side on the same data; and ours also as its recipe trains it (`ours-recipe`, the head a user's run makes) when its
best configuration on dev is another.

The data is a nested subset of the protocol's (the same permutation, the grid's `speed.rows` rows: 50 steps an
epoch at 8 samples a step), so that each run reaches its second epoch soon: our trainer reads in epoch 2 the target
statistics it kept in epoch 1. Per round, in turns (ours, speculators, SpecForge, so that a host that drifts weighs
on all alike), each trainer trains a fresh run of epoch 1 and `speed.window` steps of epoch 2, and its tokens/s is
timed over two windows: `speed.window` steps after `speed.warmup` steps of epoch 1, and the first `speed.window`
steps of epoch 2 (real tokens over wall time, less a peer's checkpointing and validation between epochs). After
`speed.rounds` rounds, one more run of each trainer has `speed.profile` steps of each window profiled by category
(`step_profile.py`: attention, loss), and the ratios are also given at equal attention and loss
(`step_profile.kernel_ratios`: the peer given ours' time in them, the peer's taken out, both sides' taken out).

Writes benchmarks/results/peers-protocol/speed-<processor kind>.json after every run (a later run on the same kind
resumes from its rounds, and from the runs of a round cut off, when the data and the configurations are the same)
and prints the table. The configurations are those chosen on the dev figures of this machine's data, or
(`--chosen-on HASH`) of the heads' data made on another processor kind: the table's choice, timed here. Exits
non-zero when a run makes other steps than asked, when a window is not in the epoch it should be, or when a peer's
best configuration is not known yet.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import protocol
from protocol import PEERS, ProtocolError, best_config, configuration, load_heads, packed_rows, speculators_rows
from step_profile import kernel_ratios

ORDER = ("ours", "ours-recipe", "speculators", "specforge")  # the timed runs' labels, in the order of a round
RATIO = {"ours": "ours_over", "ours-recipe": "recipe_over"}  # summary keys: each of ours over each peer


def trainer_of(label: str) -> str:
    return "ours" if label in RATIO else label


def timed(best: dict[str, str]) -> dict[str, str]:
    """The runs of a round, label -> configuration: each trainer's best on dev, and ours also at its recipe's head
    when its best is another (item 6 names the recipe's; the table reports the best)."""
    out = dict(best)
    if "ours" in best and best["ours"] != "recipe":
        out["ours-recipe"] = "recipe"
    return {t: out[t] for t in ORDER if t in out}


def windows(epoch1_steps: int, s: dict) -> list[tuple[int, int]]:
    """The timed windows: steps warmup+1..warmup+window of epoch 1 and the first `window` steps of epoch 2."""
    if epoch1_steps < s["warmup"] + s["window"]:
        raise ProtocolError(f"speed: epoch 1 has {epoch1_steps} steps, fewer than speed.warmup + speed.window "
                            f"({s['warmup']} + {s['window']}): raise speed.rows in the grid")
    return [(s["warmup"] + 1, s["warmup"] + s["window"]), (epoch1_steps + 1, epoch1_steps + s["window"])]


def ours_steps(run_dir: Path) -> tuple[list[float], list[int], list[int]]:
    """(end time, real tokens, epoch) of each optimizer step of our run, from its metrics.jsonl (log_every=1)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/tokens" in r]
    return [r["time"] for r in rows], [r["train/tokens"] for r in rows], [r["epoch"] for r in rows]


def check_epochs(name: str, wins: list[tuple[int, int]], epochs: list[int] | None, outside: list[list[float]] | None,
                 ends: list[float]) -> str:
    """Each window lies in its epoch: ours by the epoch it logged at every step; speculators by its checkpointing
    and validation between the last step of epoch 1 and the first of epoch 2; SpecForge by construction (rows /
    micro-batch steps an epoch, no step records its epoch). -> how it was checked."""
    (a1, b1), (a2, b2) = wins
    if epochs is not None:
        if set(epochs[a1 - 1:b1]) != {0} or set(epochs[a2 - 1:b2]) != {1}:
            raise ProtocolError(f"speed: {name}: steps {a1}..{b1} logged epochs {sorted(set(epochs[a1 - 1:b1]))} and "
                                f"steps {a2}..{b2} {sorted(set(epochs[a2 - 1:b2]))}: expected 0 and 1")
        return "the epoch logged at each step"
    if outside is not None:
        if not any(ends[a2 - 2] <= a <= ends[a2 - 1] for a, _ in outside):
            raise ProtocolError(f"speed: {name}: no checkpointing or validation between steps {a2 - 1} and {a2}: "
                                "its epoch 1 is not the one the protocol replayed")
        return "its validation between epochs, after step " + str(a2 - 1)
    return "by construction: rows / micro-batch steps an epoch"


def run_trainer(ctx: SimpleNamespace, label: str, config: str, work: Path, epoch1: int,
                profile: list[tuple[int, int]] | None = None) -> dict:
    """One fresh run of `label`'s trainer at `config` (in work/label) for epoch 1 and speed.window steps of epoch 2
    -> its steps' end times, tokens, the spans outside training, its epochs (ours) and its profile (with `profile`)."""
    import side_by_side as sbs
    from step_profile import profiled

    trainer = trainer_of(label)
    s, conf, b = ctx.grid["speed"], configuration(ctx.grid, trainer, config), ctx.grid["budget"]
    steps = epoch1 + s["window"]
    args = SimpleNamespace(recipe=ctx.grid["data"]["recipe"], base=ctx.base, reuse=False, depth=ctx.cfg.train.depth,
                           steps=steps, micro_batch=b["micro_batch"], seed=0, peer_layers=1, mask_token_id=2)
    out = {"steps_asked": steps}
    try:
        if trainer == "ours":
            fixed = [f["override"] for f in ctx.grid["trainers"]["ours"].get("fixed") or []]
            with profiled("ours", None if profile is None else [work / label / "profile.json", *sum(profile, ())]
                          ) as prof:
                sbs.ours(args, [f"store.layers=[{ctx.layers}]", "target.device=cpu", f"train.steps={steps}",
                                f"train.micro_batch={b['micro_batch']}", "train.seed=0", *fixed, *conf["overrides"]],
                         label, work, timing_only=True)
            ends, tokens, epochs = ours_steps(work / label)
            out.update(ends=ends, tokens=tokens, epochs=epochs, outside=None)
            if prof is not None:
                out["profile"] = prof.record()
        elif trainer == "speculators":
            h = sbs.speculators(args, ctx.peers, work, trainer, settings=conf["flags"], seq=ctx.seq, epochs=2,
                                profile=profile)
            out.update(**h["steps"], epochs=None, profile=h.get("profile"))
        else:
            h = sbs.specforge(args, ctx.peers_json, work, trainer, settings=conf["flags"], overrides=conf["overrides"],
                              profile=profile)
            out.update(**h["steps"], epochs=None, profile=h.get("profile"))
    except RuntimeError as e:  # a launcher's failure or a step count other than asked
        raise ProtocolError(f"speed: {label} ({config}): {e}") from None
    if len(out["ends"]) != steps:
        raise ProtocolError(f"speed: {label} ({config}) made {len(out['ends'])} optimizer steps, {steps} asked")
    return out


def epoch1_steps(ctx: SimpleNamespace, trainer: str) -> int:
    """Optimizer steps of epoch 1: rows / micro-batch (ours, SpecForge); speculators' packed rows of epoch 0 at
    its --total-seq-len (its sampler replayed)."""
    if trainer == "speculators":
        return len(packed_rows(ctx.lengths, ctx.seq, 0, 0))
    rows, mb = ctx.grid["speed"]["rows"], ctx.grid["budget"]["micro_batch"]
    if rows % mb:
        raise ProtocolError(f"speed.rows {rows}: a multiple of budget.micro_batch ({mb}), so every epoch has whole steps")
    return rows // mb


def summary(rounds: list[dict], profiles: dict, chosen: dict) -> dict:
    """Medians over rounds, the per-round ratios of ours (`ours_over`; at its recipe's head `recipe_over`) over each
    peer (median, range), and with profiles the ratios at equal attention and loss (`step_profile.kernel_ratios`:
    the window's shares of the profiled run, on the median ratio)."""
    trainers = [t for t in ORDER if t in chosen]
    out = {"tokens_per_s": {}, **{RATIO[o]: {} for o in RATIO if o in chosen}}
    for t in trainers:
        out["tokens_per_s"][t] = {e: {"median": statistics.median(r[t][e] for r in rounds),
                                      "min": min(r[t][e] for r in rounds), "max": max(r[t][e] for r in rounds)}
                                  for e in ("epoch1", "epoch2")}
    for o, p in ((o, p) for o in RATIO if o in chosen for p in trainers if p in PEERS):
        out[RATIO[o]][p] = {}
        for i, e in enumerate(("epoch1", "epoch2")):
            ratios = [r[o][e] / r[p][e] for r in rounds]
            x = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            if o in profiles and p in profiles:
                share = {t: profiles[t]["results"][i]["share_total"] for t in (o, p)}
                x.update(share_ours=share[o], share_peer=share[p], **kernel_ratios(x["median"], share[o], share[p]))
            out[RATIO[o]][p][e] = x
    return out


def print_speed(rec: dict) -> None:
    s = rec["summary"]
    print(f"\ntrainer tokens/s, {len(rec['rounds'])} interleaved rounds, {rec['speed']['window']} steps timed in epoch 1 "
          f"(after {rec['speed']['warmup']}) and in epoch 2; {rec['processor']}, {rec['machine']['threads']} threads")
    on, here = rec["chosen_on"], rec["dataset"]["token_ids_sha256"]
    if on["token_ids_sha256"] != here:
        print(f"configurations chosen on the dev figures of data {on['token_ids_sha256'][:12]} "
              f"({', '.join(on['processors'])}); timed on this machine's data {here[:12]}")
    if muon := (rec.get("adjusted_kernels") or {}).get("muon_fp32_gemms"):
        print(f"{', '.join(muon)}: Muon's bf16 Newton-Schulz products by fp32 GEMMs (this CPU has no AMX)")
    print(f"{'trainer':<13}{'configuration':<15}{'epoch 1':>22}{'epoch 2':>22}")
    for t, e in s["tokens_per_s"].items():
        print(f"{t:<13}{rec['chosen'][t]:<15}" + "".join(
            f"{x['median']:>10.0f} [{x['min']:.0f}, {x['max']:.0f}]".rjust(22) for x in e.values()))
    for o in (o for o in RATIO if RATIO[o] in s):
        for p, e in s[RATIO[o]].items():
            for name, x in e.items():
                line = f"{o} ({rec['chosen'][o]}) / {p}, {name}: {x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}]"
                if "kernels_out" in x:
                    line += (f"; attention and loss {x['share_peer']:.0%} of its step, {x['share_ours']:.0%} of "
                             f"ours: the peer with ours' {x['peer_with_ours']:.2f}, without the peer's "
                             f"{x['peer_kernels_out']:.2f}, without both sides' {x['kernels_out']:.2f}")
                print(line)


def speed_path(results: Path, processor: str) -> Path:
    """results/speed-<processor kind>.json: tokens/s are of one processor kind, and each kind keeps its rounds."""
    return Path(results) / f"speed-{protocol.processor_kind(processor)}.json"


def chosen_on(heads: dict[str, dict], here: str | None, asked: str | None) -> str:
    """The dataset hash whose seed-0 dev heads choose each trainer's configuration: this machine's data's (`here`),
    or (`--chosen-on PREFIX`, at least 6 hex digits) the heads' of another processor kind, whose data differs (the
    choice was made on dev there; the speed is measured here)."""
    hashes = {h["dataset"]["token_ids_sha256"] for h in heads.values()}
    if asked is None:
        if here in hashes:
            return here
        raise ProtocolError(f"speed: no head of this machine's data ({(here or '?')[:12]}) chose the configurations; "
                            f"the heads' JSONs hold: {protocol.held_hashes(heads)}. Give --chosen-on HASH to time "
                            "the configurations chosen on that data's dev figures")
    found = [d for d in hashes if d.startswith(asked.lower())]
    if len(asked) < 6 or len(found) != 1:
        raise ProtocolError(f"speed: --chosen-on {asked!r} matches {len(found)} datasets of the heads' JSONs "
                            f"({protocol.held_hashes(heads)}): give at least 6 digits of one")
    return found[0]


def bf16_optimizer(trainer: str, conf: dict) -> bool:
    """Whether a configuration's optimizer computes in bfloat16: speculators' default, Muon
    (speculators/train/config/schema.py:340), whose torch.optim.Muon runs its Newton-Schulz iterations in bf16."""
    flags = conf["flags"]
    return trainer == "speculators" and (flags[flags.index("--optimizer") + 1] if "--optimizer" in flags
                                         else "muon") == "muon"


def kernels(grid: dict, chosen: dict[str, str], cpuinfo: str) -> dict:
    """What the timed runs compute otherwise than as released, by this CPU: on one without AMX, the timed
    configurations that optimise with Muon run its bf16 Newton-Schulz products by fp32 GEMMs (side_by_side.py
    muon_flags: torch's bf16 GEMMs took 39-49x their fp32 time there, three quarters of the peer's step,
    benchmarks/peers/muon_cpu.py, RESULTS `peers`), so that its tokens/s times the trainer, not the processor's bf16.
    -> {"muon_fp32_gemms": [labels]} (empty where none)."""
    from mtp_train.data.regen_engines import has_amx

    if has_amx(cpuinfo):
        return {}
    muon = [t for t, c in chosen.items() if bf16_optimizer(trainer_of(t), configuration(grid, trainer_of(t), c))]
    return {"muon_fp32_gemms": muon} if muon else {}


def run_speed(grid: dict, args, prepare) -> int:
    """The speed stage (the module's docstring); `prepare` is protocol.prepare."""
    import side_by_side as sbs
    import torch

    from mtp_train.data.regen_engines import read_cpuinfo
    from protocol import sha256
    from timing import machine

    s = grid["speed"]
    heads = load_heads(args.results)
    processor = protocol.this_processor()
    if args.chosen_on is None:  # the checks come before any data is made (an hour on a fresh machine)
        protocol.check_processor(heads, processor, args.results, "give --chosen-on HASH to time here the "
                                 "configurations chosen on one's dev figures")
    # the protocol's subset made on this machine chooses, unless the choice is named (then only the speed subset
    # is made, by prepare below)
    here = None if args.chosen_on is not None else protocol.subset_data(grid, args.work.resolve())["token_ids_sha256"]
    on = chosen_on(heads, here, args.chosen_on)
    current = {n: h for n, h in heads.items() if h["dataset"]["token_ids_sha256"] == on}
    chosen = timed({t: best_config(current, grid, t) for t in args.only})  # timed() orders them as a round
    speed_grid = {**grid, "data": {**grid["data"], "rows": s["rows"]}}
    ctx = prepare(speed_grid, args.work.resolve() / "speed")
    ctx.seq = speculators_rows(ctx.lengths, 0, 2 * s["rows"] // grid["budget"]["micro_batch"],
                               ctx.reference)["total_seq_len"]
    epoch1 = {t: epoch1_steps(ctx, trainer_of(t)) for t in chosen}
    wins = {t: windows(epoch1[t], s) for t in chosen}
    out_path = speed_path(args.results, processor)
    key = {"dataset": ctx.dataset, "processor": processor, "chosen_on": {
               "token_ids_sha256": on, "processors": sorted({h["processor"] for h in current.values()})},
           "chosen": chosen, "speed": s, "adjusted_kernels": kernels(grid, chosen, read_cpuinfo()),
           "configurations": {t: configuration(grid, trainer_of(t), c) for t, c in chosen.items()}}
    rec = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if any(rec.get(k) != v for k, v in key.items()):
        rec = {}  # other data or other configurations: start again
    rec = {**key, "windows": wins, "epoch1_steps": epoch1, "speculators_total_seq_len": ctx.seq,
           "machine": machine(torch.get_num_threads()),
           "grid_sha256": sha256(args.grid), "rounds": rec.get("rounds", []), "profiles": rec.get("profiles", {}),
           "epoch_check": rec.get("epoch_check", {}), "partial_round": rec.get("partial_round", {})}

    def save() -> None:
        rec["summary"] = summary(rec["rounds"], rec["profiles"], chosen) if rec["rounds"] else None
        rec["date"] = time.strftime("%Y-%m-%d %H:%M")
        args.results.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(rec, indent=1) + "\n")

    while len(rec["rounds"]) < s["rounds"]:
        r = len(rec["rounds"])
        row = rec["partial_round"]  # the runs of a round cut off (a session's end) stay; the rest follow in turn
        for t, c in chosen.items():
            if t in row:
                print(f"protocol: speed round {r + 1}/{s['rounds']}: {t} ({c}) ran before this run", flush=True)
                continue
            print(f"protocol: speed round {r + 1}/{s['rounds']}: {t} ({c})", flush=True)
            got = run_trainer(ctx, t, c, ctx.work / "speed" / f"round{r}", epoch1[t])
            rec["epoch_check"][t] = check_epochs(t, wins[t], got["epochs"], got["outside"], got["ends"])
            outside = got["outside"] or []
            row[t] = {f"epoch{i + 1}": sbs.window_speed(got["ends"], got["tokens"], outside, a, b)
                      for i, (a, b) in enumerate(wins[t])}
            row[t]["tokens_per_step"] = statistics.fmean(got["tokens"])
            save()  # each run kept as it ends: a round is 30 min on 2 cores
        rec["rounds"].append(row)
        rec["partial_round"] = {}
        save()
        print(f"protocol: speed round {r + 1}: " + ", ".join(
            f"{t} {x['epoch1']:.0f} / {x['epoch2']:.0f} tok/s" for t, x in row.items()), flush=True)
    for t, c in chosen.items():
        if t not in rec["profiles"]:
            print(f"protocol: speed: profiling {t} ({c})", flush=True)
            prof = [(a, min(b, a + s["profile"] - 1)) for a, b in wins[t]]
            got = run_trainer(ctx, t, c, ctx.work / "speed" / "profile", epoch1[t], profile=prof)
            if not got.get("profile") or got["profile"].get("error"):
                raise ProtocolError(f"speed: {t}: profile: {(got.get('profile') or {}).get('error', 'none written')}")
            rec["profiles"][t] = got["profile"]
            save()
    save()
    print_speed(rec)
    return 0
