"""The weight average of `train.ema_decay`: an exponential moving average of the head's weights, kept in fp32
beside each parameter, which evaluations measure and checkpoints' head.safetensors hold (the trained weights go
on in trainer_state for the resume). A plain dict, parameter name -> fp32 tensor."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def start_average(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The average at the head's current (initial) weights."""
    return {n: p.detach().float().clone() for n, p in head.named_parameters()}


def update_average(average: dict[str, torch.Tensor], head: torch.nn.Module, ema_decay: float, step: int) -> None:
    """After optimizer step t (`step`): ema <- d·ema + (1 - d)·w, d = min(ema_decay, (1 + t) / (10 + t)) (the ramp
    lets the average leave the untrained start quickly; later steps approach the set decay)."""
    d = min(ema_decay, (1 + step) / (10 + step))
    with torch.no_grad():
        for n, p in head.named_parameters():
            average[n].mul_(d).add_(p.detach().float(), alpha=1 - d)


@contextmanager
def averaged_weights(head: torch.nn.Module, average: dict[str, torch.Tensor] | None):
    """The head holds the weight average inside, its trained weights again after (nothing changes without one)."""
    if average is None:
        yield
        return
    params = dict(head.named_parameters())
    trained = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(average[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(trained[n])
