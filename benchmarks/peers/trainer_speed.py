"""Each EAGLE-3 trainer's tokens/s at the same shapes, interleaved: ours, speculators and SpecForge each train a
short run on the same SmolLM2 samples with the matched settings of `side_by_side.py`, in turns, `--rounds`
times, so that a machine that slows down or speeds up during the benchmark (a shared host) weighs on every
trainer alike. Per trainer: tokens/s of each round (real tokens of steps 2..N over their wall time) and the
median over rounds; the ratios are of medians.

    python benchmarks/peers/trainer_speed.py --base runs/smol-e3sd --data runs/peers-smollm2/data --steps 20 --rounds 2
    python benchmarks/peers/trainer_speed.py --base runs/smol-e3sd --data runs/peers-smollm2/data --steps 150 \
        --rounds 1 --trainers ours speculators --variants recompute=train.target_stats_cache_mb=0 \
        subnormals=train.flush_denormals=false

`--data` is the peers' data that `side_by_side.py` wrote for `--base` (its `peers.json`; not needed with
`--trainers ours`, which times our trainer and its `--variants` alone). 20 steps of 8 samples
stay inside the first epoch of SmolLM2's 495 train samples; 150 steps (`side_by_side.py`'s budget) are 2.4
epochs, where our trainer reads the target's full-vocabulary stats it kept from the first (`loss.TargetStats`);
`--variants NAME=OVERRIDE,...` times further runs of ours (that cache off; subnormal floats kept, which our
trainer flushes on CPUs; `head.num_layers=2` beside `--peer-layers 2`, speculators with two decoder layers),
`--trainers` picks who runs. Ratios are like for like by layer count: each peer against the run of ours with as many
decoder layers (`ours_over_peer`; `ours_over_fastest_peer` is the smallest of them). Writes
benchmarks/results/peers-trainer_speed[-<steps>][-<tag>].json (no step suffix for 20 steps) and prints the table.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from step_profile import kernel_ratios  # noqa: E402
from timing import command, machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=None,
                    help="side_by_side.py's peers' data (with peers.json); needed when a peer trains")
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--work", type=Path, default=Path("runs/peers-speed"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mask-token-id", type=int, default=2)
    ap.add_argument("--trainers", nargs="+", default=["ours", "speculators", "specforge"],
                    choices=["ours", "speculators", "specforge"])
    ap.add_argument("--variants", nargs="*", default=[], help="further runs of ours: NAME=OVERRIDE,OVERRIDE,...")
    ap.add_argument("--peer-layers", type=int, default=1, help="speculators' decoder layers (side_by_side.py's "
                    "option; a variant of ours with head.num_layers=N is the matched run)")
    ap.add_argument("--tag", default="", help="a suffix for the JSON's name (a later run beside an earlier one)")
    ap.add_argument("--profile", type=int, nargs=2, metavar=("FIRST", "LAST"), default=None,
                    help="after the rounds, one more run of each trainer with its steps FIRST..LAST profiled by "
                    "category (step_profile.py: attention, loss) and the ratios with those shares taken out")
    args = ap.parse_args()
    if args.profile and not 2 <= args.profile[0] <= args.profile[1] <= args.steps:
        ap.error(f"--profile {args.profile[0]} {args.profile[1]}: give 2 <= FIRST <= LAST <= --steps {args.steps}")
    if args.peer_layers < 1:
        ap.error(f"--peer-layers {args.peer_layers}: speculators' decoder layers, 1 or more")
    peer_trainers = [t for t in args.trainers if t != "ours"]
    if peer_trainers and args.data is None:
        ap.error(f"--data (side_by_side.py's peers' data) is needed to train {', '.join(peer_trainers)}")
    args.base, args.work = args.base.resolve(), args.work.resolve()
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    import side_by_side as sbs

    if args.data is not None:
        args.data = args.data.resolve()
        peers_json = args.data / "peers.json"
        peers = json.loads(peers_json.read_text())
        layers = peers["num_layers"]
    else:  # ours alone: the target's layer count from the recipe
        layers = sbs.target_layers(args.recipe, args.base)
    args.warmup, args.reuse = max(1, args.steps // 10), False
    matched = sbs.matched_overrides(sbs.common_overrides(layers), args)
    variants = dict(v.split("=", 1) for v in args.variants)
    peers_run = {"speculators": lambda work, profile=None: sbs.speculators(args, peers, work, profile=profile),
                 "specforge": lambda work, profile=None: sbs.specforge(args, peers_json, work, profile=profile)}
    # ours, then a peer, then a variant of ours, then the other peer: what a drifting host does weighs on all
    order = [n for n in ("ours", "speculators") if n in args.trainers] + [f"ours-{v}" for v in variants] + \
        (["specforge"] if "specforge" in args.trainers else [])
    rounds: dict[str, list[dict]] = {n: [] for n in order}
    for r in range(args.rounds):
        work = args.work / f"round{r}-{args.steps}"
        for n in order:
            if n in peers_run:
                rounds[n].append(peers_run[n](work)["speed"])
            else:
                extra = sbs.split_overrides(variants[n[5:]]) if n != "ours" else []
                rounds[n].append(sbs.ours(args, [*matched, *extra], n, work, timing_only=True)["speed"])
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]['tokens_per_s']:.0f} tok/s" for n, v in rounds.items()),
              flush=True)
    profiles = {}
    if args.profile:  # one more run each, profiled (the profiler's overhead stays out of the rounds' figures)
        from step_profile import profiled

        work = args.work / f"profile-{args.steps}"
        for n in order:
            if n in peers_run:
                profiles[n] = peers_run[n](work, [tuple(args.profile)])["profile"]["results"][0]
            else:
                extra = sbs.split_overrides(variants[n[5:]]) if n != "ours" else []
                with profiled("ours", [work / n / "profile.json", *args.profile]) as prof:
                    sbs.ours(args, [*matched, *extra], n, work, timing_only=True)
                profiles[n] = prof.record()["results"][0]
            print(f"profile {n}: " + ", ".join(f"{c} {x['share']:.1%}" for c, x in profiles[n]["categories"].items())
                  + f" of its steps {args.profile[0]}..{args.profile[1]} (profiler overhead "
                  f"{profiles[n]['overhead']:.2f}x)", flush=True)
    median = {n: statistics.median(x["tokens_per_s"] for x in v) for n, v in rounds.items()}
    layers = {"ours": 1, **{f"ours-{v}": layer_count(sbs.split_overrides(o)) for v, o in variants.items()},
              "speculators": args.peer_layers, "specforge": 1}
    like = like_for_like(median, layers, profiles)
    print(f"\ntrainer tokens/s, {args.steps} steps x {args.micro_batch} samples, depth {args.depth}, {args.rounds} "
          f"interleaved rounds ({machine(torch.get_num_threads())})")
    for n, v in rounds.items():
        print(f"{n:<18}" + "".join(f"{x['tokens_per_s']:>9.0f}" for x in v) + f"   median {median[n]:.0f}"
              + (f"   {like[n]['ours']} / this {like[n]['ratio']:.2f} ({layers[n]} layers)" if n in like else "")
              + (f"; with ours' attention and loss {like[n]['ratio_peer_with_ours']:.2f}, without its "
                 f"{like[n]['ratio_peer_kernels_out']:.2f}, without both sides' {like[n]['ratio_kernels_out']:.2f}"
                 if n in like and "ratio_kernels_out" in like[n] else ""))
    name = "peers-trainer_speed" + ("" if args.steps == 20 else f"-{args.steps}") + (f"-{args.tag}" if args.tag else "")
    out = HERE.parent / "results" / f"{name}.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(torch.get_num_threads()),
                               "command": command("peers/trainer_speed.py", args), "matched_overrides": matched,
                               "variants": variants, "rounds": rounds, "median_tokens_per_s": median,
                               "layers": {n: layers[n] for n in median}, "ours_over_peer": like,
                               "profiles": profiles,
                               "fastest_peer": min(like, key=lambda p: like[p]["ratio"]) if like else None,
                               "ours_over_fastest_peer": min(x["ratio"] for x in like.values()) if like else None},
                              indent=1) + "\n")
    print(f"wrote {out}")


def layer_count(overrides: list[str]) -> int:
    """A run of ours' decoder layers: `head.num_layers` among its overrides, else 1 (the matched settings')."""
    return next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("head.num_layers=")), 1)


def like_for_like(median: dict[str, float], layers: dict[str, int], profiles: dict | None = None) -> dict:
    """Each peer against the run of ours with its layer count (a one-layer run of ours is not set against a
    two-layer peer): {peer: {"ours": run, "layers": n, "ratio": ours / peer}}; a peer with no such run of ours is
    left out. The fastest peer is the one with the smallest ratio. With both runs profiled, also the ratios at equal
    attention and loss (`step_profile.kernel_ratios`, prefixed `ratio_`); a share is of the profiled run, applied
    to the rounds' median."""
    out = {}
    for peer in ("speculators", "specforge"):
        ours = next((n for n in median if n.startswith("ours") and layers[n] == layers.get(peer)), None)
        if peer in median and ours:
            out[peer] = {"ours": ours, "layers": layers[peer], "ratio": median[ours] / median[peer]}
            if profiles and peer in profiles and ours in profiles:
                share = {n: profiles[n]["share_total"] for n in (ours, peer)}
                out[peer].update(share_ours=share[ours], share_peer=share[peer], **{
                    f"ratio_{k}": v for k, v in kernel_ratios(out[peer]["ratio"], share[ours], share[peer]).items()})
    return out


if __name__ == "__main__":
    main()
