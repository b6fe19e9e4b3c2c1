"""Checkpoints that describe themselves and resume exactly: this module writes them and resumes from them;
reading a trained head out of one (what validate, generate and export do) is `mtp_train.model.checkpoint`.

    run_dir/checkpoints/step-000500/
        head.safetensors     the head's own weights (never the frozen E / W); with train.ema_decay their average
        head.json            how to rebuild it: variant, head config, the target's config.json and identity
        optimizer.safetensors + optimizer.json
                             optimizer state (single process and DDP): its tensors, and the rest as JSON
        deepspeed/           instead of the optimizer files under DeepSpeed: its engine checkpoint, one optimizer
                             partition per rank (resumable at the same world size and ZeRO stage)
        trainer_state.safetensors + trainer_state.json
                             step, data position, scheduler, RNG states (python, torch, cuda; every rank's);
                             with train.ema_decay the trained weights (`live_head`) the resume goes on from
        config.yaml          the resolved run config
        sha256.json          size and sha256 of every file above, written last
    run_dir/checkpoints/latest   the name of the newest complete checkpoint

No pickle: a state is written as its tensors (safetensors) and a JSON skeleton naming them, so reading a
checkpoint never runs code from whoever wrote it. Checkpoints of earlier versions (`optimizer.pt`,
`trainer_state.pt`) are read with `torch.load(weights_only=True)`, which accepts tensors and plain values
only and refuses anything else. DeepSpeed's own files under `deepspeed/` are its format (torch.save), which
DeepSpeed unpickles in full; they are checked against `sha256.json`, then read with `weights_only=True` and an
allow-list of DeepSpeed's classes (`distributed.check_deepspeed_files`) before DeepSpeed reads them.

A resume takes the newest checkpoint whose files match `sha256.json` (`newest_intact`): a damaged or
truncated one is named and skipped for the one before it, and with none intact the resume stops.

`head.safetensors` is always the full head, whatever the strategy (gathered from the ranks under ZeRO-3),
so export reads any checkpoint. A checkpoint is written under `step-NNNNNN.tmp` (`begin`; under torchrun
every rank may write its part there) and renamed when complete (`commit`); `latest` is replaced atomically
after the rename, so it never names a partial checkpoint. Older checkpoints beyond `keep` are removed.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtp_train.files import fsync_path, replace_dir, sha256_file, write_atomic
# reading a checkpoint's head (and the layout's names) lives below training: validate, generate, export and
# a resume read it alike
from mtp_train.model.checkpoint import (CHECKSUMS, LATEST, checkpoint_root, has_state, latest,  # noqa: F401
                                        load_head_state, load_meta, verify)

STATE_FORMAT = 1


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
    save_file({k: v.detach().contiguous().cpu() for k, v in head_state.items()}, str(tmp / "head.safetensors"),
              metadata={"format": "pt", "step": str(step)})
    (tmp / "head.json").write_text(json.dumps(head_meta, indent=2) + "\n")
    save_state(tmp, "trainer_state", {**trainer_state, "rng": rng_state() if rng is None else rng})
    (tmp / "config.yaml").write_text(config_yaml)


# -- states without pickle ----------------------------------------------------------------------------------
def _encode(x, tensors: dict[str, torch.Tensor], where: str, seen: set[int]):
    """`x` as JSON, its tensors moved into `tensors` (named by their order) and referenced as {"$tensor": name}."""
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        name = str(len(tensors))
        tensors[name] = t
        return {"$tensor": name}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        items = [_encode(v, tensors, f"{where}[{i}]", seen) for i, v in enumerate(x)]
        return items if isinstance(x, list) else {"$tuple": items}
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in x):
            return {k: _encode(v, tensors, f"{where}.{k}", seen) for k, v in x.items()}
        return {"$items": [[_encode(k, tensors, f"{where} key", seen), _encode(v, tensors, f"{where}[{k!r}]", seen)]
                           for k, v in x.items()]}
    raise TypeError(f"{where}: a {type(x).__name__} cannot go into a checkpoint (tensors, numbers, strings, None, "
                    "lists, tuples and dicts can)")


def _decode(x, tensors: dict[str, torch.Tensor]):
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if isinstance(x, dict):
        if set(x) == {"$tensor"}:
            return tensors[x["$tensor"]]
        if set(x) == {"$tuple"}:
            return tuple(_decode(v, tensors) for v in x["$tuple"])
        if set(x) == {"$items"}:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in x["$items"]}
        return {k: _decode(v, tensors) for k, v in x.items()}
    return x


def save_state(directory: Path, name: str, state) -> None:
    """`state` (nested dicts, lists, tuples of tensors and plain values) as `name.safetensors` + `name.json`.
    Floats go through JSON exactly (shortest round-trip repr; NaN and infinities included)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, name, set())
    save_file(tensors, str(directory / f"{name}.safetensors"), metadata={"format": "pt"})
    (directory / f"{name}.json").write_text(json.dumps({"format": STATE_FORMAT, "state": skeleton}) + "\n")


def load_state(directory: Path, name: str):
    """What `save_state` wrote; a checkpoint of an earlier version (`name.pt`) is read with
    `torch.load(weights_only=True)` and refused, unread, when it holds anything but tensors and plain values."""
    meta = directory / f"{name}.json"
    if meta.is_file():
        doc = json.loads(meta.read_text())
        if doc.get("format") != STATE_FORMAT:
            raise ValueError(f"{meta}: state format {doc.get('format')!r}, this version reads {STATE_FORMAT}")
        return _decode(doc["state"], load_file(str(directory / f"{name}.safetensors")))
    legacy = directory / f"{name}.pt"
    if legacy.is_file():
        try:
            return torch.load(legacy, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{legacy} (a checkpoint file of an earlier version, a pickle) holds more than tensors "
                             "and plain values, so it is not loaded: unpickling it would run code from whoever wrote "
                             f"it. Resume from another checkpoint or start a new run_dir. ({str(e).splitlines()[0]})"
                             ) from None
    raise FileNotFoundError(f"{directory} has no {name}.json (nor an earlier version's {name}.pt): the checkpoint is "
                            "incomplete; resume from another one")


# -- integrity --------------------------------------------------------------------------------------------
def write_checksums(directory: Path) -> None:
    """sha256.json: the size and sha256 of every file under `directory` (its subdirectories included)."""
    files = sorted(f for f in directory.rglob("*") if f.is_file() and f.name != CHECKSUMS)
    record = {str(f.relative_to(directory)): {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files}
    (directory / CHECKSUMS).write_text(json.dumps({"files": record}, indent=1) + "\n")


def newest_intact(root: Path, say: Callable[[str], None] = print) -> Path | None:
    """The checkpoint to resume from: the one `latest` names when its files match their checksums, else the
    newest older one that does (the damaged ones named in a message). None when there is no checkpoint at
    all; an error when there are checkpoints and none is intact (never a silent start from step 0)."""
    pointer = root / LATEST
    named = root / pointer.read_text().strip() if pointer.is_file() else None
    found = checkpoints(root)
    if named is None and not found:
        return None
    top = step_of(named) if named is not None and step_of(named) is not None else None
    candidates = ([named] if named is not None else []) + [p for p in reversed(found)
                                                           if top is None or step_of(p) < top]
    bad = []
    for path in candidates:
        if not path.is_dir():
            bad.append(f"{path.name} (named by {pointer.name}) is missing")
            continue
        checked = verify(path)  # None: no sha256.json to check against
        present = {f: (path / f).is_file() for f in ("head.safetensors", "head.json")}
        present["trainer_state.json"] = has_state(path, "trainer_state")
        problems = list(checked or [])
        problems += [f"{f} is missing" for f, here in present.items() if not here and f"{f} is missing" not in problems]
        if not problems:
            if bad:
                say(f"train: skipping damaged checkpoints: {'; '.join(bad)}. Resuming from {path.name}, the newest "
                    "intact one")
            if checked is None:
                say(f"train: {path.name} has no {CHECKSUMS} (written by an earlier version): its files are not "
                    "verified")
            return path
        bad.append(f"{path.name}: {', '.join(problems)}")
    raise ValueError(f"no intact checkpoint in {root}: {'; '.join(bad)}. Restore a checkpoint, or start a new run_dir "
                     "(resume=false)")


def commit(root: Path, step: int, keep: int = 2) -> Path:
    """Make `begin`'s directory the checkpoint of `step`: on disk, renamed, named by `latest`, older ones pruned."""
    name = f"step-{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    write_checksums(tmp)
    for f in sorted(tmp.rglob("*"), key=lambda p: -len(p.parts)):  # on disk before the rename makes it visible
        fsync_path(f)
    fsync_path(tmp)
    replace_dir(tmp, final)  # the same step saved again: the old copy stays until the new one is in place
    fsync_path(root)
    write_atomic(root / LATEST, name + "\n")
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
    save_state(tmp, "optimizer", optimizer_state)
    return commit(root, step, keep)


def load_states(path: Path) -> tuple[dict | None, dict]:
    """(optimizer state, trainer state) of a checkpoint. The optimizer state is None for a DeepSpeed checkpoint
    (its partitions are under `deepspeed/`)."""
    optimizer = load_state(path, "optimizer") if has_state(path, "optimizer") else None
    return optimizer, load_trainer_state(path)


def load_trainer_state(path: Path) -> dict:
    return load_state(path, "trainer_state")
