"""A trained head read from a checkpoint directory: what validate, generate, export and the benchmarks load,
below training and inference alike (training's `mtp_train.train.checkpoint` writes and resumes checkpoints;
the layout is described there).

    run_dir/checkpoints/latest        the name of the newest complete checkpoint
    run_dir/checkpoints/step-NNNNNN/  head.safetensors (the head's weights), head.json (how to rebuild it),
                                      sha256.json (size and sha256 of every file, written last), and the
                                      training state a resume reads
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from mtp_train.files import sha256_file
from mtp_train.model.config import HeadConfig
from mtp_train.model.head import DraftHead
from mtp_train.model.target import target_fingerprint

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

LATEST = "latest"
CHECKSUMS = "sha256.json"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def has_state(directory: Path, name: str) -> bool:
    """Whether a checkpoint holds the state `name` (`name.json` + `.safetensors`, or an earlier version's `.pt`)."""
    return (directory / f"{name}.json").is_file() or (directory / f"{name}.pt").is_file()


def verify(directory: Path, only: tuple[str, ...] | None = None) -> list[str] | None:
    """What is wrong with a checkpoint's files against its sha256.json (`only`: those files), [] when nothing;
    None when it has no sha256.json (written by an earlier version: nothing to check against)."""
    record_path = directory / CHECKSUMS
    if not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{CHECKSUMS} is unreadable ({e})"]
    problems = []
    for rel, want in record.items():
        if only is not None and rel not in only:
            continue
        f = directory / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"{rel} has {f.stat().st_size:,} bytes, {want['bytes']:,} were written")
        elif sha256_file(f) != want["sha256"]:
            problems.append(f"{rel} does not match its sha256")
    return problems


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint, or None when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "head.safetensors").is_file() or not has_state(path, "trainer_state"):
        raise ValueError(f"{pointer} names {path.name}, which is missing or incomplete; write the name of an "
                         f"existing step-* directory of {root} into it, or use another run_dir")
    return path


def load_head_state(path: Path) -> dict[str, torch.Tensor]:
    """The head's weights, checked against the checkpoint's sha256.json first."""
    problems = verify(path, only=("head.safetensors",))
    if problems:
        raise ValueError(f"checkpoint {path} is damaged: {', '.join(problems)}")
    return load_file(str(path / "head.safetensors"))


def load_meta(path: Path) -> dict:
    return json.loads((path / "head.json").read_text())


def trained_head(run_dir: str | Path) -> Path:
    """run_dir/checkpoints/latest, or an error that says to train first."""
    root = checkpoint_root(run_dir)
    path = latest(root)
    if path is None:
        raise FileNotFoundError(f"no trained head in {root} (no `latest` checkpoint): run mtp-train train first, "
                                f"with the same recipe and run_dir={run_dir}")
    return path


def read_head(cfg: RunConfig, path: Path | None = None):
    """The head of a checkpoint directory (default `run_dir/checkpoints/latest`) as a `DraftHead` in fp32 on
    the CPU, and its head.json with `checkpoint` set. Refuses a checkpoint trained for another target."""
    path = trained_head(cfg.run_dir) if path is None else Path(path)
    if not (path / "head.safetensors").is_file() or not (path / "head.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no head.safetensors and head.json); name a "
                                f"step-* directory of {Path(cfg.run_dir) / 'checkpoints'}")
    meta = load_meta(path)
    if meta.get("target_fingerprint") != target_fingerprint(cfg.target.path):
        raise ValueError(f"checkpoint {path} was trained for target {meta.get('target_path')}, not for this run's "
                         f"target {cfg.target.path} (their config / weight fingerprints differ)")
    head = DraftHead(AutoConfig.from_pretrained(cfg.target.path), HeadConfig(**meta["head"]))
    head.load_state_dict(load_head_state(path))
    meta["checkpoint"] = str(path)
    return head.eval().requires_grad_(False), meta
