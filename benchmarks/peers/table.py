"""The peers protocol's table (`protocol.py --table`), assembled from the heads' JSONs alone: per trainer, its best
configuration's seeds on each test set, τ(k) and the τ(3) it implies with 95% intervals from a two-level bootstrap
(seeds, then prompts: `mtp_train/validate/testset.py`), acceptance by position, greedy identity; ours over the best
peer per test set. The table is of one dataset hash and processor; heads of others are named as left out.
"""

from __future__ import annotations

import json
from collections import Counter

from muon_cpu import MUON_ADJUSTMENT
from protocol import PEERS, TRAINERS, ProtocolError, best_config, head_name, load_heads, mean_dev_tau

MEAN = "mean of the test sets"  # the row of each trainer's mean over the sets, and of ours over the best peer on it


def split_heads(heads: dict[str, dict], digest: str | None = None) -> tuple[dict, dict, str, str]:
    """(the heads of the table, those left out with why, its hash, its processor): the table's hash is `digest`,
    else the one most heads with test figures hold; its processor the one most of its heads ran on."""
    judged = [h for h in heads.values() if h.get("test")] or list(heads.values())
    digest = digest or Counter(h["dataset"]["token_ids_sha256"] for h in judged).most_common(1)[0][0]
    processor = Counter(h["processor"] for h in heads.values()
                        if h["dataset"]["token_ids_sha256"] == digest).most_common(1)[0][0]
    how = {name: judged_with(h) for name, h in heads.items()}
    judging = Counter(w for w in how.values() if w).most_common(1)
    kept, left = {}, {}
    for name, h in heads.items():
        if h["dataset"]["token_ids_sha256"] != digest:
            left[name] = f"other data (sha256 {h['dataset']['token_ids_sha256'][:12]})"
        elif h["processor"] != processor:
            left[name] = f"another processor ({h['processor']})"
        elif how[name] and how[name] != judging[0][0]:
            left[name] = f"judged by vLLM otherwise: {how[name]}, the table's heads {judging[0][0]}"
        elif h.get("error"):
            left[name] = f"failed: {h['error']['what']}"
        else:
            kept[name] = h
    return kept, left, digest, processor


def judged_with(head: dict) -> str | None:
    """How vLLM judged the head (engine, k, new tokens, dtype, weights, options; the same for its dev and test
    figures, else both named), as JSON; None before it was judged."""
    got = {json.dumps({k: v for k, v in head[r]["settings"].items() if k != "served"}, sort_keys=True)
           for r in ("dev", "test") if head.get(r) and head[r].get("settings")}
    return " / ".join(sorted(got)) if len(got) > 1 else next(iter(got), None)


def ratio_rows(heads: list[dict], set_name: str, upto: int) -> tuple[list[list[int]], list[list[int]]]:
    """(steps + drafts accepted at positions 1..upto, steps) per seed and prompt: τ(upto) implied, as a ratio."""
    rows = [h["test"]["sets"][set_name]["per_prompt"] for h in heads]
    if len({len(r) for r in rows}) != 1:
        raise ProtocolError(f"test set {set_name}: heads judged on {[len(r) for r in rows]} prompts: judge every "
                            "head on the same prompts (--stage test)")
    return [[p["steps"] + sum(p["accepted"][:upto]) for p in r] for r in rows], [[p["steps"] for p in r] for r in rows]


def table(heads: dict[str, dict], grid: dict, seed: int = 0) -> dict:
    """Per trainer (its best configuration's seeds) and test set: τ(k) and τ(3) implied with 95% intervals from the
    two-level bootstrap, acceptance by position and greedy identity; per test set ours / the best peer (the peer
    with the higher τ(k) there) with its interval, paired by prompt."""
    from mtp_train.validate.testset import interval, ratio_draws, seeds_interval

    k, seeds = grid["judge"]["k"], [*grid["seeds"]["dev"], *grid["seeds"]["best"]]
    out = {"trainers": {}, "ratios": {}, "incomplete": []}
    for trainer in TRAINERS:
        try:
            best = best_config(heads, grid, trainer)
        except ProtocolError as e:
            out["incomplete"].append(f"{trainer}: {e}")
            continue
        names = [head_name(trainer, best, s) for s in seeds]
        if missing := [n for n in names if not heads.get(n, {}).get("test")]:
            out["incomplete"].append(f"{trainer}: no test figures for {', '.join(missing)}: run --stage test")
            continue
        rows = [heads[n] for n in names]
        sets = {}
        for s in rows[0]["test"]["sets"]:
            (num, den), (num3, _) = ratio_rows(rows, s, k), ratio_rows(rows, s, 3)
            prompts = [p for h in rows for p in h["test"]["sets"][s]["per_prompt"]]
            steps, draws = sum(p["steps"] for p in prompts), ratio_draws(num, den, seed, stream=trainer)
            sets[s] = {"tau": interval(sum(map(sum, num)) / steps, draws),
                       "tau3": seeds_interval(num3, den, seed, stream=trainer),
                       "acceptance_by_position": [sum(p["accepted"][j] for p in prompts) / steps for j in range(k)],
                       "prompts": len(num[0]), "seeds": len(rows),
                       "greedy_identical": sum(h["test"]["sets"][s]["greedy_identical_prompts"] for h in rows),
                       "draws": draws}
        if muon := [n for n in names if (heads[n].get("adjustments") or {}).get(MUON_ADJUSTMENT)]:
            out["muon_fp32_gemms"] = out.get("muon_fp32_gemms", []) + muon
        out["trainers"][trainer] = {"configuration": best, "heads": names, "layers": rows[0].get("layers"),
                                    "floor": rows[0]["configuration"]["floor"], "sets": sets,
                                    "mean": mean_of_sets(sets)}
    peers = [p for p in PEERS if p in out["trainers"]]
    if "ours" in out["trainers"] and peers:
        figures = {t: {**out["trainers"][t]["sets"], MEAN: out["trainers"][t]["mean"]} for t in ["ours", *peers]}
        for s, mine in figures["ours"].items():  # per set, and the goal's figure: ours over the peer best on the mean
            peer = max(peers, key=lambda p: figures[p][s]["tau"]["value"])
            theirs = figures[peer][s]
            ratios = [a / b if a is not None and b else None for a, b in zip(mine["draws"], theirs["draws"])]
            out["ratios"][s] = {"peer": peer, **interval(mine["tau"]["value"] / theirs["tau"]["value"], ratios)}
    for t in out["trainers"].values():
        for s in [*t["sets"].values(), t["mean"]]:
            del s["draws"]
    return out


def mean_of_sets(sets: dict[str, dict]) -> dict:
    """τ(k) averaged over the test sets, each set weighing the same (as the dev sets do for the choice), with its
    interval: draw i of every set resamples the same seeds (one stream per trainer) and its own prompts, so the mean
    of the sets' draw i is a draw of the mean."""
    from mtp_train.validate.testset import interval

    draws = [None if None in d else sum(d) / len(d) for d in zip(*(s["draws"] for s in sets.values()))]
    return {"tau": interval(sum(s["tau"]["value"] for s in sets.values()) / len(sets), draws), "draws": draws}


def format_table(result: dict, grid: dict, digest: str, processor: str, left: dict) -> str:
    b, j, k = grid["budget"], grid["judge"], grid["judge"]["k"]
    lines = [f"peers protocol, test sets: vLLM greedy, k = {k}, float32 with weights rounded through bfloat16, "
             f"{j['new_tokens']} new tokens; {b['steps']} steps x {b['micro_batch']} conversations of the "
             f"{grid['data']['rows']:,}-conversation subset (sha256 {digest[:12]}), {processor}; 95% intervals from "
             "a two-level bootstrap (seeds, then prompts)", "",
             f"| trainer | configuration (best on dev) | layers | lr floor | test set | prompts x seeds "
             f"| τ({k}) [95%] | τ(3) implied [95%] | acceptance by position | greedy identical |", "|---" * 10 + "|"]
    cell = lambda x: f"{x['value']:.3f} [{x['low']:.3f}, {x['high']:.3f}]"  # noqa: E731
    for trainer, t in result["trainers"].items():
        for name, s in t["sets"].items():
            lines.append(f"| {trainer} | {t['configuration']} | {t['layers']} | {t['floor']} | {name} | "
                         f"{s['prompts']} x {s['seeds']} | {cell(s['tau'])} | {cell(s['tau3'])} | "
                         f"{' '.join(f'{a:.3f}' for a in s['acceptance_by_position'])} | "
                         f"{s['greedy_identical']}/{s['prompts'] * s['seeds']} |")
        lines.append(f"| {trainer} | {t['configuration']} | {t['layers']} | {t['floor']} | {MEAN} | — | "
                     f"{cell(t['mean']['tau'])} | — | — | — |")
    if result["ratios"]:
        lines += ["", f"| test set | ours / best peer, τ({k}) [95%] |", "|---|---|"]
        lines += [f"| {s} | {cell(r)} over {r['peer']} |" for s, r in result["ratios"].items()]
    notes = [f"incomplete: {x}" for x in result["incomplete"]] + [f"left out: {n}: {why}" for n, why in left.items()]
    if muon := result.get("muon_fp32_gemms"):
        notes.append(f"{', '.join(muon)}: Muon's bf16 Newton-Schulz products computed by fp32 GEMMs (no AMX on "
                     "this processor; docs/peers.md, the adjustments)")
    lines += [""] * bool(notes) + notes
    return "\n".join(lines)


def dev_summary(heads: dict[str, dict], grid: dict) -> str:
    """Each configuration's seed-0 mean dev τ(5), the chosen one marked (dev figures: chosen on them)."""
    lines = ["dev (seed 0, mean τ over the dev sets; * = chosen):"]
    for trainer in TRAINERS:
        try:
            best = best_config(heads, grid, trainer)
        except ProtocolError:
            best = None
        cells = [f"{c['name']} {mean_dev_tau(h):.3f}{'*' if c['name'] == best else ''}"
                 for c in grid["trainers"][trainer]["configs"]
                 if (h := heads.get(head_name(trainer, c["name"], grid["seeds"]["dev"][0]))) and h.get("dev")]
        lines.append(f"  {trainer}: {', '.join(cells) or 'none judged'}")
    return "\n".join(lines)


def print_table(grid: dict, args) -> int:
    """The dev summary and the table printed, the table's JSON written beside the heads' folder; -> 1 when a head
    the table needs is missing, raises when heads of other data or processors are there (unless --leave-out)."""
    heads = load_heads(args.results)
    if not heads:
        raise ProtocolError(f"no head JSONs in {args.results}: run --stage dev first")
    kept, left, digest, processor = split_heads(heads, args.hash)
    print(dev_summary(kept, grid) + "\n")
    result = table(kept, grid)
    print(format_table(result, grid, digest, processor, left))
    out = args.results.parent / f"{args.results.name}-table.json"
    out.write_text(json.dumps({"dataset_sha256": digest, "processor": processor, "left_out": left, **result},
                              indent=1) + "\n")
    print(f"wrote {out}")
    if left and not args.leave_out:
        raise ProtocolError(f"{len(left)} heads are not of this table's data and processor ({', '.join(left)}): "
                            "train them again (--stage ...), or pass --leave-out to leave them out, named")
    return 1 if result["incomplete"] else 0
