"""`python -m mtp_train.train.memory_check recipe=NAME ...`: the per-GPU memory estimate (`memory.py`) of a recipe
before launching it, composed from the recipe and overrides as `mtp-train` does; exits 1 when it does not fit."""

from __future__ import annotations

import sys

import torch

from mtp_train.config import ConfigError, compose
from mtp_train.train.distributed import resolve_strategy
from mtp_train.train.memory import GIB, H100_80GB, estimate_memory, online_bytes


def main(argv: list[str] | None = None) -> int:
    """`python -m mtp_train.train.memory_check recipe=NAME target.path=DIR [key=value ...] [--world N] [--gpu-gib G]`:
    the estimate for a recipe before launching it (reads only the target's config.json). --world is the
    number of processes (default 8), --gpu-gib the memory of one GPU (default an 80 GB H100)."""
    args = list(sys.argv[1:] if argv is None else argv)
    world, gpu = 8, H100_80GB
    try:
        for flag in ("--world", "--gpu-gib"):
            if flag in args:
                k = args.index(flag)
                value = args[k + 1]
                del args[k:k + 2]
                world, gpu = (int(value), gpu) if flag == "--world" else (world, int(float(value) * GIB))
    except (IndexError, ValueError):
        print(main.__doc__, file=sys.stderr)
        return 2
    recipe = next((a.split("=", 1)[1] for a in args if a.startswith("recipe=")), "tiny")
    try:
        cfg = compose(recipe, [*args, "run_dir=unused"] if not any(a.startswith("run_dir=") for a in args) else args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    strategy = resolve_strategy(cfg.train.strategy, world, torch.device("cuda"))
    est = estimate_memory(cfg.target.path, cfg.train, cfg.data.max_length, world, strategy, cfg.head,
                          online_target=online_bytes(cfg))
    what = f"{strategy}{f' ZeRO-{cfg.train.zero_stage}' if strategy == 'deepspeed' else ''} x {world}, " \
           f"samples of {cfg.data.max_length} tokens"
    print(f"{recipe}: " + est.format(gpu, what))
    if not est.fits(gpu):
        print("does not fit: lower train.micro_batch, data.max_length or train.depth, or set "
              "train.activation_checkpointing=true", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
