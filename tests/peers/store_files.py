"""What the peers' tests compare with, read straight from our store's files with safetensors (the peers' venvs have
no mtp_train): per sample its token ids, loss mask and every stored hidden-state stream; and the draft vocabulary
recounted from the shards by its rule (the N most frequent tokens at trained positions, ties to the smaller id)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

DIR = Path(os.environ.get("MTP_PEERS_DIR", ""))


def manifests() -> tuple[dict, dict]:
    """(benchmarks/peers/prepare.py's manifest.json, benchmarks/peers/write.py's peers.json)"""
    if not (DIR / "manifest.json").is_file():
        pytest.skip("MTP_PEERS_DIR/manifest.json missing: run benchmarks/peers/prepare.py first (make peers)")
    manifest = json.loads((DIR / "manifest.json").read_text())
    return manifest, json.loads(Path(manifest["peers"]).read_text())


def store_samples(split_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Every sample of one store split: input_ids [T], loss_mask [T] (bool), hidden [T, H] (after the final norm)
    and layer_<i> [T, H] for each stored layer, float32 (the tiny store is float32)."""
    m = json.loads((split_dir / "manifest.json").read_text())
    assert m["dtype"] == "float32"
    out = []
    for shard in m["shards"]:
        with safe_open(str(split_dir / shard["file"]), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        offsets = t["offsets"].tolist()
        for a, b in zip(offsets, offsets[1:]):
            s = {"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b].bool(),
                 "hidden": t["hidden"][a:b]}
            s.update({f"layer_{i}": t[f"layer_{i}"][a:b] for i in m["layers"]})
            out.append(s)
    return out


def draft_ids(split_dir: Path, n: int, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in store_samples(split_dir):
        counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=vocab_size)
    return torch.sort(-counts, stable=True).indices[:n].sort().values


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def final_norm(target: Path) -> tuple[torch.Tensor, float]:
    """The target's final norm weight and epsilon."""
    config = json.loads((target / "config.json").read_text())
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.norm.weight").float(), config["rms_norm_eps"]


def check_profile(path: Path, trainer: str, steps: int) -> None:
    """A launcher's --profile record: every scope of the trainer's categories fired, attention and loss each with
    forward and backward time, and no moment counted twice."""
    prof = json.loads(Path(path).read_text())
    assert prof["trainer"] == trainer and prof["steps_made"] == steps and "error" not in prof, prof
    assert len(prof["results"]) == len(prof["windows"])
    for window in prof["results"]:
        cats = window["categories"]
        assert set(cats) == {"attention", "loss"}
        assert all(c["forward_s"] > 0 and c["backward_s"] > 0 for c in cats.values()), cats
        assert 0 < window["share_total"] < 1.05
