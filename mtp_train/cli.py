"""The command line: `mtp-train <stage> recipe=<name> run_dir=<dir> [key=value ...]`.

Parses, composes the recipe into a typed RunConfig, writes it into run_dir, and calls one stage. The
stages live in the library; nothing there imports this module.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtp_train import __version__
from mtp_train.config import ConfigError, RunConfig, available_recipes, compose, to_yaml, write_resolved
from mtp_train.files import run_lock, write_atomic
from mtp_train.preempt import EXIT_PREEMPTED, PREEMPTED_FILE, Preempted, StopRequests

EXIT_USAGE, EXIT_FAILED, EXIT_NOT_BUILT = 2, 1, 3


@dataclass(frozen=True)
class Stage:
    help: str
    entry: str | None  # "module:function" taking a RunConfig; None while the stage is not built yet
    section: str | None = None  # this config section's keys may be given bare (generate: prompt=..., k=...)
    verbatim: tuple[str, ...] = ()  # keys whose value is free text, taken as typed (not parsed by Hydra)
    writes_config: bool = True  # records the resolved config in run_dir (not for generate: no artifact)


PIPELINE = ("prepare", "precompute", "train", "validate", "export")
STOPPABLE = ("prepare", "precompute", "train")  # a stop request exits 75: the same command goes on
STAGES: dict[str, Stage] = {
    "prepare": Stage("conversations / text -> token ids + assistant-only loss masks (run_dir/data)",
                     "mtp_train.data.prepare:run"),
    "precompute": Stage("run the target once over the data, store its final hidden states (run_dir/store)",
                        "mtp_train.store.precompute:run"),
    "train": Stage("fit the draft head on the stored hidden states (run_dir/checkpoints)",
                   "mtp_train.train.trainer:run"),
    "validate": Stage("teacher-forced metrics + real speculative decoding: loss, accuracy, tau "
                      "(run_dir/validation/report.json)", "mtp_train.validate.run:run"),
    "test": Stage("the test report: tau and speed-up on the test prompt sets at the setting chosen on dev "
                  "(run_dir/validation/test.json)", "mtp_train.validate.testset:run"),
    "export": Stage("write the head in serving layouts: format=hf-mtp|eagle|deepseek-nextn (run_dir/export)",
                    "mtp_train.export.run:run", section="export"),
    "pipeline": Stage("run prepare -> precompute -> train -> validate -> export in order", "mtp_train.cli:run_pipeline"),
    "info": Stage("check the recipe's target and draft: derived architecture, tokenizer, a greedy sample",
                  "mtp_train.info:run"),
    "generate": Stage("decode a prompt: prompt=\"...\" speculative=head|draft|none k=4 temperature=0",
                      "mtp_train.generate:run", section="generate", verbatim=("generate.prompt",),
                      writes_config=False),
}


# Commands that take a path rather than a recipe.
TOOLS: dict[str, str] = {
    "verify-store": "DIR: recheck a store's checksums and counts (DIR: run_dir/store or one split); names bad shards",
}


class StageNotBuilt(RuntimeError):
    pass


def usage() -> str:
    width = max(map(len, [*STAGES, *TOOLS]))
    stages = "\n".join(f"  {name:<{width}}  {s.help}{'' if s.entry else '  [not built yet]'}"
                       for name, s in STAGES.items())
    tools = "\n".join(f"  {name:<{width}}  {text}" for name, text in TOOLS.items())
    return f"""mtp-train {__version__}: train, validate and export speculative-decoding draft heads

usage: mtp-train <stage> [recipe=<name|file.yaml>] [run_dir=<dir>] [key=value ...] [--cfg]

stages:
{stages}

tools:
{tools}

recipes (recipes/*.yaml): {', '.join(available_recipes())}
  recipe defaults to 'tiny' (the embedded target); run_dir defaults to runs/<recipe>.
  Any config key can be overridden as key=value (e.g. target.dtype=bfloat16); unknown keys fail.
  --cfg prints the resolved config and exits without running the stage.
"""


def resolve_entry(name: str) -> Callable[[RunConfig], object]:
    stage = STAGES[name]
    if stage.entry is None:
        raise StageNotBuilt(f"stage {name!r} is not built yet: nothing was run")
    module, func = stage.entry.split(":")
    return getattr(importlib.import_module(module), func)


def stage_overrides(stage: Stage, overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """Expand the stage's bare keys (`k=2` -> `generate.k=2` for generate) and take out the free-text
    ones, so a prompt with spaces, commas or quotes needs no Hydra quoting. -> (overrides, {key: text})."""
    if stage.section is None:
        return overrides, {}
    from dataclasses import fields

    section_cls = next(f.default_factory for f in fields(RunConfig) if f.name == stage.section)
    section_keys = {f.name for f in fields(section_cls)}
    out, text = [], {}
    for o in overrides:
        key, _, value = o.partition("=")
        if key in section_keys:
            key = f"{stage.section}.{key}"
        if key in stage.verbatim:
            text[key] = value
        else:
            out.append(f"{key}={value}" if "=" in o else o)
    return out, text


def run_pipeline(cfg: RunConfig) -> None:
    for name in PIPELINE:
        if STAGES[name].entry is None:
            raise StageNotBuilt(f"stage {name!r} is not built yet: the pipeline stopped before it")
        if name == "precompute" and cfg.train.features != "store":
            print(f"== precompute: skipped (train.features={cfg.train.features}: the trainer computes the features)",
                  flush=True)
            continue
        print(f"== {name}", flush=True)
        resolve_entry(name)(cfg)


def verify_store_main(args: list[str]) -> int:
    """`mtp-train verify-store DIR`: 0 when every shard is good, 1 when any is bad or DIR holds no store."""
    text = f"usage: mtp-train verify-store DIR\n  {TOOLS['verify-store']}"
    if args in (["-h"], ["--help"]):
        print(text)
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print(f"error: verify-store takes one directory\n{text}", file=sys.stderr)
        return EXIT_USAGE
    from mtp_train.store.verify import verify_store

    try:
        return 0 if verify_store(args[0]) else EXIT_FAILED
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else EXIT_USAGE
    if args[0] in ("-V", "--version"):
        print(__version__)
        return 0
    stage, rest = args[0], args[1:]
    if stage == "verify-store":
        return verify_store_main(rest)
    if stage not in STAGES:
        print(f"error: unknown stage {stage!r}; expected one of {', '.join(STAGES)}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return EXIT_USAGE
    if any(a in ("-h", "--help") for a in rest):
        print(f"mtp-train {stage}: {STAGES[stage].help}\n\n{usage()}")
        return 0
    try:  # a stop request from here on, before the stage is even imported, exits 75 (mtp_train/preempt.py)
        with StopRequests(stage, "during start-up", at_once=True) if stage in STOPPABLE else contextlib.nullcontext():
            return run_stage(stage, rest)
    except Preempted as e:  # SIGTERM / SIGUSR1: stopped at a safe point, the work so far kept
        print(str(e), file=sys.stderr)
        return EXIT_PREEMPTED


def run_stage(stage: str, rest: list[str]) -> int:
    """`mtp-train <stage> [key=value ...]` once the stage is known: compose, record the config, run."""
    show_cfg = "--cfg" in rest
    overrides = [a for a in rest if a != "--cfg"]
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        print(f"error: unknown option {flags[0]!r}; options are --help and --cfg, the rest is key=value",
              file=sys.stderr)
        return EXIT_USAGE
    recipe = next((a.split("=", 1)[1] for a in overrides if a.startswith("recipe=")), "tiny")
    overrides, text = stage_overrides(STAGES[stage], overrides)
    try:
        cfg = compose(recipe, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    for key, value in text.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    if show_cfg:
        print(to_yaml(cfg), end="")
        return 0
    try:
        entry = resolve_entry(stage)
        # under torchrun the first process writes the config, speaks, and holds the run_dir's lock (one writer
        # per run_dir) for all of them
        writer = int(os.environ.get("RANK", "0")) == 0 and STAGES[stage].writes_config
        with run_lock(cfg.run_dir, stage) if writer else contextlib.nullcontext():
            if writer:
                (Path(cfg.run_dir) / PREEMPTED_FILE).unlink(missing_ok=True)  # an earlier stop's: honoured now
                path = write_resolved(cfg, Path(cfg.run_dir))
                print(f"mtp-train {stage}: recipe {cfg.recipe}, run_dir {cfg.run_dir} (config: {path})", flush=True)
            entry(cfg)
    except Preempted as e:
        if int(os.environ.get("RANK", "0")) == 0:  # for a batch script behind torchrun (see preempt.py)
            with contextlib.suppress(OSError):
                write_atomic(Path(cfg.run_dir) / PREEMPTED_FILE, f"{e}\n")
        raise
    except StageNotBuilt as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NOT_BUILT
    except (OSError, ValueError) as e:  # bad inputs: the message names what and where
        if os.environ.get("MTP_TRAIN_DEBUG"):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
