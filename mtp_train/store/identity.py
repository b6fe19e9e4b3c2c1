"""The run's identity a store records and is checked against: which target (its fingerprint), tokenizer (a
hash of its files) and prepared data (a hash of `run_dir/data/manifest.json`) its hidden states came from.
Paths are recorded for the messages only; the digests decide."""

from __future__ import annotations

from pathlib import Path

from mtp_train.files import sha256_file
from mtp_train.model.target import TOKENIZER_FILES, target_fingerprint, tokenizer_hash

IDENTITY_KEYS = {"target": "fingerprint", "tokenizer": "sha256", "data": "sha256"}  # part -> the digest compared


class StoreMismatch(ValueError):
    """A store made from another target, tokenizer, dataset or config than the one it is used with."""


def target_identity(path: str | Path) -> dict:
    return {"path": str(Path(path).resolve()), "fingerprint": target_fingerprint(path)}


def tokenizer_identity(path: str | Path) -> dict:
    p = Path(path)
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {p}")
    return {"path": str(p.resolve()), "sha256": tokenizer_hash(p)}


def data_identity(manifest_path: str | Path) -> dict:
    p = Path(manifest_path)
    if not p.is_file():
        raise FileNotFoundError(f"data manifest not found: {p} (run `mtp-train prepare` first)")
    return {"path": str(p.resolve()), "sha256": sha256_file(p)}


def identity_for(target_path: str | Path | None = None, tokenizer_path: str | Path | None = None,
                 data_manifest_path: str | Path | None = None) -> dict:
    """The identity a manifest records: {"target": {path, fingerprint}, "tokenizer": {path, sha256},
    "data": {path, sha256}}, each None when not given. The tokenizer defaults to the target's directory
    (where the pipeline reads it from); the data part hashes `run_dir/data/manifest.json`."""
    tokenizer_path = tokenizer_path if tokenizer_path is not None else target_path
    return {"target": target_identity(target_path) if target_path is not None else None,
            "tokenizer": tokenizer_identity(tokenizer_path) if tokenizer_path is not None else None,
            "data": data_identity(data_manifest_path) if data_manifest_path is not None else None}


def identity_mismatches(recorded: dict, current: dict, where: str | Path) -> list[str]:
    """One sentence per part of `current` (target, tokenizer, data; None parts are not checked) that
    differs from what the store at `where` recorded, naming both sides."""
    problems = []
    for part, digest in IDENTITY_KEYS.items():
        cur = current.get(part)
        if cur is None:
            continue
        rec = recorded.get(part)
        if rec is None:
            problems.append(f"store {where} records no {part}, so it cannot be checked against this run's {part} "
                            f"{cur['path']} ({digest} {cur[digest][:16]})")
        elif rec.get(digest) != cur[digest]:
            problems.append(f"store {where} was made from {part} {rec.get('path')} ({digest} "
                            f"{str(rec.get(digest))[:16]}), this run's {part} is {cur['path']} "
                            f"({digest} {cur[digest][:16]})")
    return problems
