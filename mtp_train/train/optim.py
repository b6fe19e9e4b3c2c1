"""The trainer's optimizer and learning-rate schedule: AdamW (weight decay on the matrices only), linear
warm-up to `train.lr`, then cosine decay to `train.lr · train.min_lr_ratio` at the last step."""

from __future__ import annotations

import math

import torch

from mtp_train.train.config import TrainConfig


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(head: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the head's parameters: `train.weight_decay` on those with 2 or more dimensions, none on the
    others (norms, biases)."""
    decay = [p for n, p in head.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in head.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=tc.lr, betas=tuple(tc.betas), eps=1e-8)


def build_scheduler(optimizer: torch.optim.Optimizer, tc: TrainConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_lambda` over `total_steps` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, tc.warmup_steps, total_steps, tc.min_lr_ratio))
