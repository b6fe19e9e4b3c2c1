"""Checkpoints that describe themselves and resume exactly.

    run_dir/checkpoints/step-000500/
        head.safetensors     the head's own weights (never the frozen E / W)
        head.json            how to rebuild it: variant, head config, the target's config.json and identity
        optimizer.pt         optimizer state
        trainer_state.pt     step, data position, scheduler, RNG states (python, torch, cuda)
        config.yaml          the resolved run config
    run_dir/checkpoints/latest   the name of the newest complete checkpoint

A checkpoint is written under `step-NNNNNN.tmp` and renamed when complete; `latest` is replaced atomically
after the rename, so it never names a partial checkpoint. Older checkpoints beyond `keep` are removed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

LATEST = "latest"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def step_of(path: Path) -> int | None:
    """The step of a `step-NNNNNN` directory name, None for anything else (e.g. `step-000100.tmp`)."""
    name = path.name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def checkpoints(root: Path) -> list[Path]:
    """Complete-looking checkpoint directories, oldest step first (numeric, not by name)."""
    found = [p for p in root.glob("step-*") if p.is_dir() and step_of(p) is not None] if root.is_dir() else []
    return sorted(found, key=step_of)


def save(root: Path, step: int, head_state: dict[str, torch.Tensor], head_meta: dict, optimizer_state: dict,
         trainer_state: dict, config_yaml: str, keep: int = 2) -> Path:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in head_state.items()}, str(tmp / "head.safetensors"),
              metadata={"format": "pt", "step": str(step)})
    (tmp / "head.json").write_text(json.dumps(head_meta, indent=2) + "\n")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    for f in tmp.iterdir():  # on disk before the rename makes the checkpoint visible
        _fsync(f)
    if final.exists():  # the same step saved again: the old copy stays until the new one is in place
        old = root / f"{name}.old"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync(root)
    _atomic_write(root / LATEST, name + "\n")
    if keep > 0:  # only ever older steps than this one: never the checkpoint `latest` now names
        older = [p for p in checkpoints(root) if step_of(p) < step]
        for p in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(p)
    return final


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint, or None when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "head.safetensors").is_file() or not (path / "trainer_state.pt").is_file():
        raise ValueError(f"{pointer} names {path.name}, which is missing or incomplete; write the name of an "
                         f"existing step-* directory of {root} into it, or use another run_dir")
    return path


def load_head_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "head.safetensors"))


def load_meta(path: Path) -> dict:
    return json.loads((path / "head.json").read_text())


def load_states(path: Path) -> tuple[dict, dict]:
    """(optimizer state, trainer state) of a checkpoint; these hold only tensors and plain Python values."""
    optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    trainer = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    return optimizer, trainer
