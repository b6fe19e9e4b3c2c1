"""Our EAGLE-3 trainer against speculators' and SpecForge's on the same samples, with matched settings, each head
judged by vLLM on the recipe's held-out prompts; and each trainer's tokens/s at the same shapes.

    python benchmarks/peers/side_by_side.py --base runs/smol-e3sd --steps 150 --micro-batch 8 --depth 3 \\
        [--lr 2e-3] [--warmup 20] [--ks 3 5] [--prompts 8] [--new-tokens 64] \\
        [--variants norms=head.norm_before_residual=true,head.norm_before_fc=true] [--peer-norms] \\
        [--judge mtp=eagle:runs/smol-mtp/export/vllm-mtp] [--reuse] [--tag T] [--no-engine]

`--base`: a prepared and precomputed run of `--recipe` (default smollm2-135m) with an eagle3 head whose store also
holds layer L (the last layer's output before the final norm: `store.layers=[30]` for SmolLM2). Steps:
1. `write.py` writes the store in both peers' formats (our draft vocabulary for both), when a peer trains;
2. our trainer, speculators (`run_speculators.py`) and SpecForge (`run_specforge.py`) train with the same steps,
   peak lr, linear warm-up steps, cosine to 0, AdamW betas (0.9, 0.999), weight decay 0, gradient clipping 1.0,
   TTT depth and 0.8 per step, the distribution over the draft vocabulary (KL / soft CE, the same gradient), one
   full-attention layer, the aux layers, frozen embeddings, and our architecture (no norm before fc, residual
   from g, the step's output fed back before the norm); what cannot be matched is listed in SETTINGS_NOT_MATCHED;
3. vLLM (`.venv-vllm`, method eagle3) serves each head on the val prompts, greedy, at each k: output compared
   with vLLM's target-only output, acceptance by position and τ from vLLM's counters; our engine on our export.

`--variants NAME=OVERRIDES` trains further heads of ours (comma-separated overrides on top of the matched ones);
`--peer-norms` also trains speculators with its three norm options on (`--norm-before-residual --norm-before-fc
--norm-output`, its defaults), the peers' side of a head of ours with the norms (SpecForge's EAGLE-3 layer has
none of them); `--judge NAME=METHOD:DIR` has vLLM serve an export already made (the recipe's `vllm-mtp` head,
through our plugin, method eagle); `--reuse` keeps a head already trained in `--work` (its record and export)
instead of training it again; `--tag T` writes peers-side_by_side-T.json and vLLM's outputs under --work/vllm-T
(a re-judging of heads already made, `--only --judge ...`, keeps the earlier figures); `--no-engine` leaves our
engine's decoding of our heads out (vLLM's figures only).

Writes benchmarks/results/peers-side_by_side.json and prints the tables. Tokens/s: real (unpadded) tokens of
steps 2..N over their wall time (the first step compiles or warms up), torch threads = 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from muon_cpu import MUON_ADJUSTMENT  # noqa: E402
from timing import PLAIN_HEAD, command, machine  # noqa: E402

SETTINGS_NOT_MATCHED = [
    "speculators packs samples into rows of --total-seq-len tokens (no batch size): set to micro_batch x the mean "
    "train length; it does not split samples, so its rows hold fewer real tokens (SmolLM2: 2,281 a step against "
    "our 2,482 on average; 8% fewer tokens over the run)",
    "speculators runs every one of --epochs, one step each past --max-steps: given exactly the epochs that hold "
    "the steps, and its last epoch's checkpoint (at --max-steps) is served, not its checkpoint_best",
    "sample order: each trainer shuffles with its own generator (ours length-buckets)",
    "out-of-draft-vocabulary targets: ours and SpecForge give no loss to positions whose target argmax is outside "
    "the draft vocabulary; speculators trains them on the target renormalised over the draft vocabulary",
    "loss normalisation: SpecForge averages over all (padded) positions, speculators over packed positions, ours "
    "over trained positions (AdamW makes the scale matter little)",
    "SpecForge clears the last position's loss mask of every sample (it has no next token); ours never trains it either",
    "speculators' and SpecForge's checkpoints are written in bfloat16 (ours in the export dtype, float32 here)",
]


def target_layers(recipe: str, base: Path) -> int:
    """The target's decoder-layer count, from the recipe's target as `base` (a prepared run dir) configures it."""
    from mtp_train.config import compose
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(compose(recipe, [f"run_dir={base}"]).target.path).num_hidden_layers


def common_overrides(layers: int, extra: list[str] = ()) -> list[str]:
    """Our eagle3 run on the base store (which also holds layer `layers`, the pre-norm final state)."""
    return [*PLAIN_HEAD, "head.variant=eagle3", f"store.layers=[{layers}]", "train.loss.w_feat=0", "target.device=cpu",
            *extra]


def split_overrides(text: str) -> list[str]:
    """`a=1,b=[0.9,0.95]` -> [`a=1`, `b=[0.9,0.95]`]: the commas between overrides, not those inside a list."""
    return [o for o in re.split(r",(?![^\[]*\])", text) if o]


def matched_overrides(common: list[str], args) -> list[str]:
    """Our trainer's settings matched to what both peers are given (the module docstring)."""
    return [*common, f"train.steps={args.steps}", f"train.micro_batch={args.micro_batch}",
            f"train.depth={args.depth}", f"train.lr={args.lr}", f"train.warmup_steps={args.warmup}",
            "train.min_lr_ratio=0", "train.betas=[0.9,0.999]", "train.weight_decay=0", "train.max_grad_norm=1.0",
            "train.loss.gamma=0.8", f"train.seed={args.seed}"]


def ours(args, cfg_overrides: list[str], name: str, work: Path, timing_only: bool = False) -> dict:
    """Our head trained with `cfg_overrides` in work/name, its teacher-forced figures, its export and its
    tokens/s; with `timing_only`, trained and timed only."""
    from ablation_heads import link_base, train_fresh
    from mtp_train.config import compose
    from mtp_train.export.run import run as export

    run_dir = work / name
    link_base(run_dir, args.base)
    cfg = compose(args.recipe, [f"run_dir={run_dir}", *cfg_overrides, "train.log_every=1", "train.eval_every=0",
                                   "train.save_every=0", "train.keep_checkpoints=1", "resume=false",
                                   "export.format=eagle3", "export.dtype=fp32", "validate.val_samples=48"])
    import shutil

    done = run_dir / "trained.json"
    if timing_only:
        train_fresh(cfg)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "train/tokens" in r]
        return {"speed": speed([r["time"] for r in rows], [r["train/tokens"] for r in rows])}
    if not (args.reuse and done.is_file() and json.loads(done.read_text()) == cfg_overrides):
        shutil.rmtree(run_dir / "export", ignore_errors=True)
        done.unlink(missing_ok=True)
        trainer, _ = train_fresh(cfg)
        from mtp_train.validate.teacher_forced import teacher_forced

        tf = teacher_forced(cfg, trainer.head.eval(), trainer.frozen, trainer.device, args.depth + 2)
        (run_dir / "teacher_forced.json").write_text(json.dumps(
            {"accuracy_by_depth": tf["accuracy_by_depth"], "expected_acceptance_by_depth":
             tf["expected_acceptance_by_depth"]}) + "\n")
        del trainer
        done.write_text(json.dumps(cfg_overrides))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/tokens" in r]
    try:
        if not (run_dir / "export" / "eagle3" / "config.json").is_file():
            export(cfg)
        exported, why = run_dir / "export" / "eagle3", None
    except ValueError as e:  # a head setting no layout holds yet: trained and timed, not served
        exported, why = None, str(e)
    return {"cfg": cfg, "export": exported, "not_exported": why, "overrides": cfg_overrides,
            "teacher_forced": json.loads((run_dir / "teacher_forced.json").read_text()),
            "speed": speed([r["time"] for r in rows], [r["train/tokens"] for r in rows])}


def peer_teacher_forced(export: Path, cfg, depth: int) -> dict:
    """A peer's head read as vLLM reads it (`read_engine`; its copy of the target's embedding left unread: the
    evaluation embeds with the target's), teacher-forced on our val store exactly as our heads are."""
    out = export.parent / f"{export.name}-teacher_forced.json"
    if out.is_file() and out.stat().st_mtime > (export / "model.safetensors").stat().st_mtime:
        return json.loads(out.read_text())
    from transformers import AutoConfig

    from mtp_train.export.eagle3 import read_engine
    from mtp_train.model.frozen import FrozenTarget
    from mtp_train.validate.teacher_forced import teacher_forced

    head = read_engine(export, "vllm", AutoConfig.from_pretrained(cfg.target.path), drop=("embed_tokens.",)).float()
    frozen = FrozenTarget.from_pretrained(cfg.target.path, dtype=torch.float32, device="cpu")
    tf = teacher_forced(cfg, head, frozen, torch.device("cpu"), depth)
    got = {"accuracy_by_depth": tf["accuracy_by_depth"],
           "expected_acceptance_by_depth": tf["expected_acceptance_by_depth"]}
    out.write_text(json.dumps(got) + "\n")
    return got


def window_speed(ends: list[float], tokens: list[int], outside: list[list[float]], first: int, last: int) -> float:
    """Real tokens per second of steps first..last (1-based): their tokens over the time from the end of step
    first-1 to the end of step last, less the `outside` spans inside it (a peer's checkpointing and validation)."""
    t0, t1 = ends[first - 2], ends[last - 1]
    return sum(tokens[first - 1:last]) / (t1 - t0 - seconds_within(outside, t0, t1))


def seconds_within(spans: list[list[float]], t0: float, t1: float) -> float:
    """The seconds of `spans` ([start, end], ...) that lie between t0 and t1."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)


def speed(ends: list[float], tokens: list[int], outside: list[list[float]] = ()) -> dict:
    """tokens/s of the whole run: window_speed over steps 2..N (end times in seconds, real tokens per step), less
    the `outside` spans (a peer's per-epoch checkpoints and validation; ours evaluates only before step 1 and after
    step N)."""
    if len(ends) < 2:
        return {"tokens_per_s": None, "steps": len(ends)}
    return {"tokens_per_s": window_speed(ends, tokens, outside, 2, len(ends)), "steps": len(ends),
            "tokens_per_step": sum(tokens) / len(tokens), "first_step_s": None,
            "left_out_s": seconds_within(outside, ends[0], ends[-1])}


def step_record(rec: dict, outside: bool) -> dict:
    """A peer's record.json as the launchers return it: each step's end time and real tokens, and (`outside`) the
    spans it spent outside training (speculators' checkpointing and validation between epochs), else None."""
    return {"ends": rec["step_end_s"], "tokens": rec["step_tokens"],
            "outside": rec.get("outside_s", []) if outside else None}


def speculators_settings(args, norms: bool = False) -> list[str]:
    """speculators' flags for the matched settings (the module docstring), with or without its norm options."""
    return ["--optimizer", "adamw", "--weight-decay", "0", "--lr", str(args.lr), "--scheduler-type", "cosine",
            "--scheduler-warmup-steps", str(args.warmup), "--scheduler-total-steps", str(args.steps),
            "--ttt-steps", str(args.depth), "--ttt-step-loss-decay", "0.8", "--loss-fn", "kl_div",
            *(["--norm-before-residual", "--norm-before-fc", "--norm-output"] if norms
              else ["--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"])]


def speculators(args, peers: dict, work: Path, name: str = "speculators", norms: bool = False,
                settings: list[str] | None = None, seq: int | None = None, epochs: int | None = None,
                profile: list[tuple[int, int]] | None = None) -> dict:
    """speculators trained in work/name: the data, vocabulary, CPU and step flags here, its training settings
    `settings` (default: the matched ones), rows of `seq` tokens (default: micro_batch x the mean train length)
    over `epochs` epochs (default: those that hold the steps at `seq` tokens a row); with `profile` [(first, last),
    ...], those steps profiled by category (step_profile.py) into work/name/profile.json."""
    out = work / name
    record = out / "record.json"
    settings = speculators_settings(args, norms) if settings is None else settings
    seq = seq or int(round(args.micro_batch * peers["mean_train_length"]))
    # speculators runs every one of --epochs, one step each past --max-steps (its loop checks max_steps after a
    # step): exactly the epochs that hold the steps, so its last checkpoint is the one at --max-steps
    epochs = epochs or math.ceil(args.steps * seq / peers["tokens"]["train"])
    cmd = [str(ROOT / ".venv-speculators" / "bin" / "python"), str(HERE / "run_speculators.py"), "--record",
           str(record), *profile_flags(profile, out), *muon_flags(), "--", "--verifier-name-or-path", peers["target"],
           "--data-path", peers["speculators"]["dir"],
           "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"),
           "--draft-vocab-size", str(peers["draft_vocab"]), "--d2t-path", peers["speculators"]["d2t"],
           "--t2d-path", peers["speculators"]["t2d"], "--target-layer-ids", *map(str, peers["aux_layers"]),
           "--num-layers", str(args.peer_layers), "--full-attention-indices", *map(str, range(args.peer_layers)),
           "--hidden-states-dtype", "float32", "--total-seq-len", str(seq), *settings,
           "--max-steps", str(args.steps), "--epochs", str(epochs), "--num-workers", "0", "--seed", str(args.seed),
           "--train-data-ratio", str(peers["train_data_ratio"]), "--mask-token-id", str(args.mask_token_id),
           "--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    earlier = json.loads(record.read_text()) if record.is_file() else {}
    argv = cmd[cmd.index("--") + 1:]  # speculators' own arguments
    # a record is written even by a run that died (its `finally`): reused only when it made every step
    if not (args.reuse and profile is None and earlier.get("argv") == argv
            and len(earlier.get("step_end_s", [])) == args.steps
            and (MUON_ADJUSTMENT in earlier.get("adjustments", {})) == bool(muon_flags())):
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # it resumes from checkpoints it finds
        launch(cmd, out, profile)
    rec = json.loads(record.read_text())
    steps_made(rec, args.steps, "speculators", out / "log.txt")
    # its last epoch's checkpoint (the one at --max-steps), not checkpoint_best (chosen on the held-out split)
    export = max((p for p in (out / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    steps = step_record(rec, outside=True)
    return {"export": export, "speed": speed(steps["ends"], steps["tokens"], steps["outside"]), "steps": steps,
            "adjustments": rec["adjustments"], "total_seq_len": seq, "norms": norms, "settings": argv,
            **profile_record(profile, out)}


def muon_flags() -> list[str]:
    """run_speculators.py's --muon-fp32-gemms on a CPU without AMX: torch.optim.Muon's bf16 GEMMs run 39-49x their
    fp32 time there (benchmarks/peers/muon_cpu.py), so its Newton-Schulz products are computed by fp32 GEMMs and
    rounded to bf16, the values of its bf16 iterations (docs/peers.md, the adjustments)."""
    from mtp_train.data.regen_engines import has_amx, read_cpuinfo

    return [] if has_amx(read_cpuinfo()) else ["--muon-fp32-gemms"]


def specforge_settings(args) -> list[str]:
    """run_specforge.py's flags for the matched settings."""
    return ["--lr", str(args.lr), "--warmup-steps", str(args.warmup), "--ttt", str(args.depth), "--max-grad-norm",
            "1.0"]


def specforge(args, peers_json: Path, work: Path, name: str = "specforge", settings: list[str] | None = None,
              overrides: list[str] = (), profile: list[tuple[int, int]] | None = None) -> dict:
    """SpecForge trained in work/name with `settings` (run_specforge.py's flags; default: the matched ones) and
    its dotted config `overrides`; with `profile` [(first, last), ...], as speculators()."""
    out = work / name
    record = out / "record.json"
    settings = specforge_settings(args) if settings is None else settings
    cmd = [str(ROOT / ".venv-specforge" / "bin" / "python"), str(HERE / "run_specforge.py"), "--peers",
           str(peers_json), "--work", str(out), "--record", str(record), "--steps", str(args.steps),
           "--epochs", "100", "--batch", str(args.micro_batch), *settings, "--seed", str(args.seed),
           *profile_flags(profile, out), *(["--", *overrides] if overrides else [])]
    export = out / "export-hf"
    stamp = out / "command.json"
    if not (args.reuse and profile is None and record.is_file() and (export / "config.json").is_file()
            and stamp.is_file() and json.loads(stamp.read_text()) == cmd):
        launch(cmd, out, profile)
        stamp.write_text(json.dumps(cmd))
    rec = json.loads(record.read_text())
    steps_made(rec, args.steps, "SpecForge", out / "log.txt")
    steps = step_record(rec, outside=False)
    return {"export": export, "speed": speed(steps["ends"], steps["tokens"]), "steps": steps,
            "adjustments": rec["adjustments"], "norms": False, "settings": cmd[2:], **profile_record(profile, out)}


def profile_flags(profile: list[tuple[int, int]] | None, out: Path) -> list[str]:
    """A peer launcher's --profile flags: the steps of each window (first, last) into out/profile.json."""
    if profile is None:
        return []
    return ["--profile", str(out / "profile.json"), *(str(step) for window in profile for step in window)]


def profile_record(profile: list[tuple[int, int]] | None, out: Path) -> dict:
    if profile is None:
        return {}
    if not (out / "profile.json").is_file():
        raise RuntimeError(f"{out}: the launcher wrote no profile.json for the steps {profile}: see {out / 'log.txt'}")
    rec = json.loads((out / "profile.json").read_text())
    if rec.get("error"):
        raise RuntimeError(f"{out}: profile: {rec['error']}")
    return {"profile": rec}


def steps_made(record: dict, asked: int, peer: str, log: Path) -> None:
    """A peer's run must make exactly the optimizer steps asked for (its record's step end times)."""
    if len(record["step_end_s"]) != asked:
        raise RuntimeError(f"{peer} made {len(record['step_end_s'])} optimizer steps, not {asked}: see {log}")


def launch(cmd: list[str], out: Path, profile: list[tuple[int, int]] | None) -> None:
    """A peer's launcher run into out/log.txt; with `profile`, an earlier run's profile.json removed first, so that
    profile_record reads this run's or none."""
    if profile is not None:
        (out / "profile.json").unlink(missing_ok=True)
    run(cmd, out / "log.txt")


def run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ,
                                                                                    "OMP_NUM_THREADS": "2"})
    if done.returncode:
        raise RuntimeError(f"{cmd[1]} failed (exit {done.returncode}): see {log}")


def judge(args, heads: dict, cfg, work: Path) -> dict:
    """vLLM on each head at each k, beside its target-only output; our engine on our exports."""
    from mtp_train.export.engine_check import compare, ours as ours_engine
    from mtp_train.inference.vllm_engine import run_vllm
    from mtp_train.data.held_out import held_out_prompts

    python = str(ROOT / ".venv-vllm" / "bin" / "python")
    prompts, source = held_out_prompts(Path(cfg.run_dir) / "data", args.prompts, cfg.validate.max_prompt_tokens)
    target = str(Path(cfg.target.path).resolve())
    folder = work / ("vllm" if not args.tag else f"vllm-{args.tag}")
    alone = run_vllm(python, target, prompts, folder / "target.json", args.new_tokens, "float32")
    if "error" in alone:
        raise RuntimeError(f"vLLM target-only: {alone['error']}")
    results = {}
    for name, head in heads.items():
        if head["export"] is None:
            results[name] = {"head": name, "error": f"not exported: {head['not_exported']}"}
            continue
        for k in args.ks:
            spec = run_vllm(python, target, prompts, folder / f"{name}-k{k}.json", args.new_tokens, "float32",
                            (head.get("method", "eagle3"), str(head["export"]), k))
            entry = {"head": name, "k": k, "error": spec.get("error")}
            if "error" not in spec:
                steps = spec["steps"]
                rate = [a / steps for a in spec["accepted_per_position"]] if steps else [0.0] * k
                entry.update({"greedy_identical": sum(a == b for a, b in zip(spec["tokens"], alone["tokens"])),
                              "prompts": len(prompts), "acceptance": rate, "tau": 1 + sum(rate), "steps": steps,
                              "seconds": spec.get("seconds")})
                if head.get("cfg") is not None and not args.no_engine:
                    mine = ours_engine(head["cfg"], prompts, k, args.new_tokens, head["export"])
                    c = compare(mine, alone, spec, k)
                    entry.update({"ours_engine_acceptance": c["ours_acceptance"],
                                  "ours_engine_tau": 1 + sum(c["ours_acceptance"])})
            results[f"{name}-k{k}"] = entry
            print(f"vLLM {name} k={k}: " + (f"tau {entry['tau']:.3f}, acceptance "
                                             + " ".join(f"{a:.3f}" for a in entry["acceptance"])
                                             + f", greedy identical {entry['greedy_identical']}/{len(prompts)}"
                                             if entry["error"] is None else f"error {entry['error']}"), flush=True)
    return {"prompts": len(prompts), "prompt_source": source, "new_tokens": args.new_tokens, "results": results,
            "vllm_version": alone.get("vllm_version")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--overrides", nargs="*", default=[], help="the base run's other overrides (e.g. head.aux_layers)")
    ap.add_argument("--work", type=Path, default=Path("runs/peers-smollm2"))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mask-token-id", type=int, default=2, help="the mask token speculators' CLI requires (its EAGLE-3 "
                                                                 "model does not use it)")
    ap.add_argument("--variants", nargs="*", default=[], help="further heads of ours: NAME=OVERRIDE,OVERRIDE,...")
    ap.add_argument("--peer-norms", action="store_true", help="also the peers with their norm options on")
    ap.add_argument("--peer-layers", type=int, default=1, help="speculators' decoder layers (--num-layers, every one "
                    "full attention), to match a head of ours with head.num_layers; its heads are then named -Nl")
    ap.add_argument("--judge", nargs="*", default=[], help="exports already made, served too: NAME=METHOD:DIR")
    ap.add_argument("--reuse", action="store_true", help="keep heads already trained in --work with these settings")
    ap.add_argument("--only", nargs="*", default=["ours", "speculators", "specforge"])
    ap.add_argument("--no-base", action="store_true", help="only the variants and --peer-norms heads (another seed)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="vLLM only: leave out our engine's decoding of our "
                    "heads (minutes per head on this CPU at 48 prompts)")
    ap.add_argument("--tag", default=None, help="names the JSON (peers-side_by_side-TAG.json) and vLLM's folder "
                    "(--work/vllm-TAG), so a re-judging with other prompts keeps the earlier figures")
    args = ap.parse_args()
    if args.peer_layers < 1:
        ap.error(f"--peer-layers {args.peer_layers}: speculators' decoder layers, 1 or more")
    args.base, args.work = args.base.resolve(), args.work.resolve()
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from mtp_train.config import compose
    from write import write

    layers = target_layers(args.recipe, args.base)
    common = common_overrides(layers, args.overrides)
    base_cfg = compose(args.recipe, [f"run_dir={args.base}", *common])
    peers_json = args.work / "data" / "peers.json"
    trains_peer = bool({"speculators", "specforge"} & set(args.only))
    if trains_peer and not peers_json.is_file():
        write(base_cfg, args.work / "data")
    peers = json.loads(peers_json.read_text()) if peers_json.is_file() else None  # a run with no peer writes none
    matched = matched_overrides(common, args)
    heads = {}
    if "ours" in args.only:
        if not args.no_base:
            heads["ours"] = ours(args, matched, "ours", args.work)
        for variant in args.variants:
            name, _, overrides = variant.partition("=")
            heads[f"ours-{name}"] = ours(args, [*matched, *split_overrides(overrides)], f"ours-{name}", args.work)
    if "speculators" in args.only:
        more = f"-{args.peer_layers}l" if args.peer_layers != 1 else ""
        if not args.no_base:
            heads[f"speculators{more}"] = speculators(args, peers, args.work, f"speculators{more}")
        if args.peer_norms:
            heads[f"speculators-norms{more}"] = speculators(args, peers, args.work, f"speculators-norms{more}",
                                                            norms=True)
    if "specforge" in args.only:
        heads["specforge"] = specforge(args, peers_json, args.work)
    for entry in args.judge:
        name, _, rest = entry.partition("=")
        method, _, path = rest.partition(":")
        heads[name] = {"export": Path(path).resolve(), "method": method, "speed": None, "judged_only": True}
    tf_cfg = compose(args.recipe, [f"run_dir={args.base}", *common, "validate.val_samples=48"])
    for name, h in heads.items():
        if not h.get("judged_only") and "teacher_forced" not in h:  # the peers' heads, on our val store
            h["teacher_forced"] = peer_teacher_forced(h["export"], tf_cfg, args.depth + 2)
        tf = h.get("teacher_forced")
        print(f"{name}: {h['speed']}" + (f"; teacher-forced acc d1..: "
                                         + " ".join(f"{a:.3f}" for a in tf["accuracy_by_depth"]) if tf else ""),
              flush=True)
    out = HERE.parent / "results" / ("peers-side_by_side.json" if args.seed == 0 and not args.tag else
                                      f"peers-side_by_side-{args.tag or f'seed{args.seed}'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    save(out, args, matched, peers, heads, None)  # the training figures, before vLLM's
    if not args.skip_vllm:
        save(out, args, matched, peers, heads, judge(args, heads, base_cfg, args.work))
    print(f"wrote {out}")


def save(out: Path, args, matched: list[str], peers: dict, heads: dict, judged: dict | None) -> None:
    settings = {n: head_settings(h["export"]) if h.get("judged_only") else
                {"trained_here": True, "argv": h.get("settings"), "overrides": h.get("overrides")}
                for n, h in heads.items()}
    seq = {n: h.get("total_seq_len") or flag_value(settings[n].get("argv"), "--total-seq-len")
           for n, h in heads.items()}
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": machine(torch.get_num_threads()),
        "command": command("peers/side_by_side.py", args),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        # a re-judging trains nothing: its command's defaults are no head's settings (each head's are below)
        "matched_overrides": matched if any(not h.get("judged_only") for h in heads.values()) else None,
        "not_matched": SETTINGS_NOT_MATCHED, "data": peers and {k: peers[k] for k in (
            "samples", "tokens", "mean_train_length", "aux_layers", "draft_vocab", "draft_vocab_summary")},
        "speed": {n: h["speed"] for n, h in heads.items()},
        "teacher_forced": {n: h["teacher_forced"] for n, h in heads.items() if h.get("teacher_forced")},
        "heads": {n: {"export": str(h["export"]), "method": h.get("method", "eagle3"), "overrides": h.get("overrides"),
                      "norms": h.get("norms"), "total_seq_len": seq[n], "settings": settings[n]}
                  for n, h in heads.items()},
        "speculators_total_seq_len": {n: v for n, v in seq.items() if v is not None},  # every speculators head
        "adjustments": {n: h.get("adjustments") for n, h in heads.items() if h.get("adjustments")},
        "vllm": judged}, indent=1, default=str) + "\n")


def flag_value(argv: list[str] | None, flag: str) -> int | None:
    """The integer after `flag` in a command line, or None."""
    return int(argv[argv.index(flag) + 1]) if argv and flag in argv else None


def head_settings(export: Path | None) -> dict:
    """The settings a head already exported was trained with, read from what its trainer left beside the export:
    ours' run dir (`trained.json`: side_by_side's overrides; its checkpoint's `config.yaml`: the resolved head and
    train settings), speculators' `record.json` (its command line), SpecForge's `command.json` and `run.yaml`;
    `settings: None` with the reason when none of them is there."""
    import yaml

    export = Path(str(export))
    places = (export.parent, export.parent.parent)
    found = {}
    for d in places:
        if (d / "trained.json").is_file():
            found["overrides"] = json.loads((d / "trained.json").read_text())
        for config in sorted(d.glob("checkpoints/*/config.yaml"))[-1:]:
            resolved = yaml.safe_load(config.read_text())
            found["config"] = {k: resolved.get(k) for k in ("head", "train")}
        if (d / "record.json").is_file() and "argv" in (rec := json.loads((d / "record.json").read_text())):
            found["argv"] = rec["argv"]
        if (d / "command.json").is_file():
            found["argv"] = json.loads((d / "command.json").read_text())
        if (d / "run.yaml").is_file():
            found["config"] = yaml.safe_load((d / "run.yaml").read_text()).get("training")
        if found:
            return {"read_from": str(d), **found}
    return {"settings": None, "why": f"no trained.json, checkpoints/*/config.yaml, record.json, command.json or "
                                     f"run.yaml in {' or '.join(map(str, places))}: made elsewhere"}


if __name__ == "__main__":
    main()
