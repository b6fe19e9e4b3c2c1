"""Validation's first half: the training objective and its metrics on the val store, teacher-forced, with the same
head forward (`model.head.unrolled`), loss (`train.loss.head_loss`) and evaluation (`train.evaluate`) as training:
the loss terms, top-1 agreement with the target's argmax and expected acceptance Σ min(p, q) per depth.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtp_train.store.reader import StoreReader
from mtp_train.train.data import length_batches, loader
from mtp_train.train.evaluate import autocast_for, evaluate
from mtp_train.train.features import online_split

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


def teacher_forced(cfg: "RunConfig", head: torch.nn.Module, frozen, device: torch.device, depth: int) -> dict:
    """The training metrics on the val store at `depth`, with the trainer's own evaluation code and its
    numerics (an fp32 head; bf16 autocast and bf16 frozen E / W when `train.precision=bf16`), on
    `validate.val_samples` samples spread evenly over the store, or all of them."""
    split = Path(cfg.run_dir) / "store" / "val"
    if (split / "manifest.json").is_file():
        reader = StoreReader(split)
        data_manifest = Path(cfg.run_dir) / "data" / "manifest.json"
        reader.check_identity(target_path=cfg.target.path, tokenizer_path=cfg.target.path,
                              data_manifest=data_manifest if data_manifest.is_file() else None)
    elif cfg.train.features == "online":  # trained without a store: the val split's states computed here
        reader = online_split(Path(cfg.run_dir), cfg.target, cfg.store, cfg.head, "val", device)
    else:
        raise FileNotFoundError(f"no hidden-state store at {split}: run mtp-train precompute with the same recipe "
                                f"and run_dir={cfg.run_dir} first (or train.features=online, or "
                                "validate.teacher_forced=false)")
    n, m = len(reader), cfg.validate.val_samples
    chosen = range(n) if not m or m >= n else [i * n // m for i in range(m)]
    batches = length_batches(reader.lengths, cfg.train.micro_batch, chosen)
    m = evaluate(head, frozen, loader(reader, batches, aux=head.aux_layers), depth, cfg.train.loss, device,
                 autocast_for(cfg.train.precision, device))
    loss = cfg.train.loss
    terms = [{"depth": d, "feat": m.get(f"d{d}/feat"), "ce": m.get(f"d{d}/ce"), "positions": m[f"d{d}/n"]}
             for d in range(1, depth + 1)]
    val_loss = sum(loss.gamma ** (t["depth"] - 1) * (loss.w_feat * t["feat"] + loss.w_logit * t["ce"])
                   for t in terms if t["positions"])
    return {"val_loss": val_loss, "val_samples": len(chosen), "loss_terms_by_depth": terms,
            "accuracy_by_depth": [m.get(f"d{d}/acc") for d in range(1, depth + 1)],
            "expected_acceptance_by_depth": [m.get(f"d{d}/accept") for d in range(1, depth + 1)]}
