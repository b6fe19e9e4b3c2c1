"""Checkpoints that describe themselves and resume exactly.

    run_dir/checkpoints/step-000500/
        head.safetensors     the head's own weights (never the frozen E / W)
        head.json            how to rebuild it: variant, head config, the target's config.json and identity
        optimizer.pt         optimizer state (single process and DDP)
        deepspeed/           instead of optimizer.pt under DeepSpeed: its engine checkpoint, one optimizer
                             partition per rank (resumable at the same world size and ZeRO stage)
        trainer_state.pt     step, data position, scheduler, RNG states (python, torch, cuda; every rank's)
        config.yaml          the resolved run config
    run_dir/checkpoints/latest   the name of the newest complete checkpoint

`head.safetensors` is always the full head, whatever the strategy (gathered from the ranks under ZeRO-3),
so export reads any checkpoint. A checkpoint is written under `step-NNNNNN.tmp` (`begin`; under torchrun
every rank may write its part there) and renamed when complete (`commit`); `latest` is replaced atomically
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


def begin(root: Path, step: int) -> Path:
    """The empty temporary directory a checkpoint of `step` is written into."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step-{step:06d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write(tmp: Path, step: int, head_state: dict[str, torch.Tensor], head_meta: dict, trainer_state: dict,
          config_yaml: str, rng: dict | list | None = None) -> None:
    """The files every checkpoint has (the optimizer state is the caller's): head weights, how to rebuild
    the head, trainer state with the RNG state(s), resolved config."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in head_state.items()}, str(tmp / "head.safetensors"),
              metadata={"format": "pt", "step": str(step)})
    (tmp / "head.json").write_text(json.dumps(head_meta, indent=2) + "\n")
    torch.save({**trainer_state, "rng": rng_state() if rng is None else rng}, tmp / "trainer_state.pt")
    (tmp / "config.yaml").write_text(config_yaml)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the complete directory `tmp` to `final`; an existing `final` is moved aside first and removed
    only once the new one is in place."""
    if final.exists():
        old = final.with_name(f"{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


def commit(root: Path, step: int, keep: int = 2) -> Path:
    """Make `begin`'s directory the checkpoint of `step`: on disk, renamed, named by `latest`, older ones pruned."""
    name = f"step-{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    for f in sorted(tmp.rglob("*"), key=lambda p: -len(p.parts)):  # on disk before the rename makes it visible
        _fsync(f)
    _fsync(tmp)
    replace_dir(tmp, final)  # the same step saved again: the old copy stays until the new one is in place
    _fsync(root)
    _atomic_write(root / LATEST, name + "\n")
    if keep > 0:  # only ever older steps than this one: never the checkpoint `latest` now names
        older = [p for p in checkpoints(root) if step_of(p) < step]
        for p in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(p)
    return final


def save(root: Path, step: int, head_state: dict[str, torch.Tensor], head_meta: dict, optimizer_state: dict,
         trainer_state: dict, config_yaml: str, keep: int = 2) -> Path:
    """A whole checkpoint from one process."""
    tmp = begin(root, step)
    write(tmp, step, head_state, head_meta, trainer_state, config_yaml)
    torch.save(optimizer_state, tmp / "optimizer.pt")
    return commit(root, step, keep)


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


def load_states(path: Path) -> tuple[dict | None, dict]:
    """(optimizer state, trainer state) of a checkpoint; these hold only tensors and plain Python values. The
    optimizer state is None for a DeepSpeed checkpoint (its partitions are under `deepspeed/`)."""
    optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False) \
        if (path / "optimizer.pt").is_file() else None
    trainer = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    return optimizer, trainer


def load_trainer_state(path: Path) -> dict:
    return torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
