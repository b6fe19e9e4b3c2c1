"""Batches from the hidden-state store: length-bucketed, deterministic per (seed, epoch), split across ranks.

An epoch's order: a seeded permutation of the samples, cut into windows of `bucket` micro-batches, sorted by
length inside each window (so a micro-batch pads little), cut into micro-batches, and the micro-batches
shuffled. Global micro-batch g goes to rank g % world, so ranks never share a sample; the list is trimmed
to whole optimizer steps (world × grad_accum micro-batches), so every rank takes the same number of steps.
The position in the data is (epoch, micro-batches consumed by this rank), which is what a checkpoint saves.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch


def epoch_batches(lengths: Sequence[int], micro_batch: int, seed: int, epoch: int, bucket: int = 32) -> list[list[int]]:
    """All micro-batches of one epoch (global order), each a list of sample indices."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = micro_batch * max(1, bucket)
    batches = []
    for s in range(0, len(order), window):
        chunk = sorted(order[s:s + window], key=lambda i: (lengths[i], i))
        batches += [chunk[k:k + micro_batch] for k in range(0, len(chunk), micro_batch)]
    batches = [b for b in batches if len(b) == micro_batch]  # equal micro-batches: same global batch everywhere
    rng.shuffle(batches)
    return batches


def rank_batches(lengths: Sequence[int], micro_batch: int, seed: int, epoch: int, rank: int, world: int,
                 grad_accum: int, bucket: int = 32) -> list[list[int]]:
    """This rank's micro-batches for an epoch, trimmed to whole optimizer steps."""
    batches = epoch_batches(lengths, micro_batch, seed, epoch, bucket)
    per_step = world * grad_accum
    batches = batches[: len(batches) // per_step * per_step]
    return batches[rank::world]


def length_batches(lengths: Sequence[int], micro_batch: int, indices: Sequence[int] | None = None) -> list[list[int]]:
    """Evaluation micro-batches: the samples `indices` (default all) in length order (little padding), cut
    every `micro_batch`. Deterministic: the trainer's validation and `mtp-train validate` batch alike."""
    chosen = range(len(lengths)) if indices is None else indices
    order = sorted(chosen, key=lambda i: (lengths[i], i))
    return [list(order[k:k + micro_batch]) for k in range(0, len(order), micro_batch)]


def steps_per_epoch(n_samples: int, micro_batch: int, world: int, grad_accum: int) -> int:
    return (n_samples // micro_batch) // (world * grad_accum)


class Collate:
    """Reads a micro-batch from a feature source (the store, or `train/features.py`'s online ones) and right-pads it: hidden [B, T, H] (float32), input_ids [B, T],
    loss_mask [B, T] bool, lengths [B], index [B] (the samples' indices in their split); with `aux` (an eagle3 head's layers) also aux [B, T, k·H], the stored
    states of those layers concatenated in that order (the head's input; `hidden` stays the loss's target)."""

    def __init__(self, reader, aux: list[int] | tuple[int, ...] = ()):
        self.reader = reader
        missing = [i for i in aux if i not in reader.layers]
        if missing:
            raise ValueError(f"store {reader.dir} holds layers {list(reader.layers)}, not {missing}, which the head "
                             f"reads: precompute with store.layers={list(aux)} (into a new run_dir, or with "
                             "store.overwrite=true)")
        self.slots = [reader.layers.index(i) for i in aux]

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        samples = self.reader.fetch(indices)
        T = max(s["input_ids"].shape[0] for s in samples)
        H = samples[0]["hidden"].shape[-1]
        B = len(samples)
        out = {"hidden": torch.zeros(B, T, H), "input_ids": torch.zeros(B, T, dtype=torch.long),
               "loss_mask": torch.zeros(B, T, dtype=torch.bool), "lengths": torch.zeros(B, dtype=torch.long),
               "index": torch.tensor(indices, dtype=torch.long)}
        if self.slots:
            out["aux"] = torch.zeros(B, T, len(self.slots) * H)
        for b, s in enumerate(samples):
            n = s["input_ids"].shape[0]
            out["hidden"][b, :n] = s["hidden"]
            out["input_ids"][b, :n] = s["input_ids"]
            out["loss_mask"][b, :n] = s["loss_mask"].bool()
            out["lengths"][b] = n
            if self.slots:
                out["aux"][b, :n] = s["layers"][self.slots].permute(1, 0, 2).reshape(n, -1)
        return out


def head_inputs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the head's first step reads: an eagle3 head's aux layers, else the final hidden states."""
    return batch["aux"] if "aux" in batch else batch["hidden"]


def loader(reader, batches: list[list[int]], num_workers: int = 0, aux: list[int] | tuple[int, ...] = ()):
    """Iterate collated micro-batches in the given order (workers prefetch; order is kept). A source that
    computes in this process (online features: the target is here) is read without workers."""
    if getattr(reader, "in_process", False):
        return map(Collate(reader, aux), batches)
    # its own generator: a DataLoader otherwise draws its base seed from the global RNG, which would make a
    # resumed run's random stream differ from an uninterrupted one
    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False, collate_fn=Collate(reader, aux),
                                       num_workers=num_workers, persistent_workers=False,
                                       generator=torch.Generator().manual_seed(0))
