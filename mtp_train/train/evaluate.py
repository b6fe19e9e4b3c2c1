"""Teacher-forced evaluation of a head: the training loss's per-depth metrics (`loss.head_loss`) over batches of
target features, weighted by counted positions and summed over all ranks. The trainer evaluates with it every
`eval_every` steps and validation (`mtp-train validate`) measures a trained head with it, so both report the
same numbers with the same numerics. The trainer's own step metrics are summed with the same helpers
(`add_weighted`, `averages`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from mtp_train.model.frozen import FrozenTarget
from mtp_train.model.head import DraftHead, unrolled
from mtp_train.train import distributed as dist
from mtp_train.train.config import LossConfig
from mtp_train.train.data import head_inputs
from mtp_train.train.loss import TargetStats, head_loss

METRICS = ("feat", "ce", "acc", "accept")  # per depth, averaged over counted positions
DRAFT_VOCAB_METRICS = METRICS + ("in_vocab",)  # with a draft vocabulary (head.draft_vocab > 0)


def metric_names(head: DraftHead, loss: LossConfig | None = None) -> tuple[str, ...]:
    """The per-depth metrics the trainer logs: `in_vocab` with a draft vocabulary, `reached` with
    `train.loss.align_topk`."""
    names = DRAFT_VOCAB_METRICS if head.cfg.draft_vocab else METRICS
    return names + ("reached",) if loss is not None and loss.align_topk else names


def add_weighted(sums: torch.Tensor, m: dict, depth: int, names: tuple[str, ...] = METRICS) -> None:
    """sums[k-1] += [n, feat·n, ce·n, acc·n, accept·n(, in_vocab·n)] of depth k from one batch's `head_loss`
    metrics."""
    for k in range(1, depth + 1):
        n = m[f"d{k}/n"]
        sums[k - 1, 0] += n
        for i, key in enumerate(names, start=1):
            sums[k - 1, i] += m.get(f"d{k}/{key}", 0.0) * n


def averages(sums: torch.Tensor, depth: int, names: tuple[str, ...] = METRICS) -> dict[str, float]:
    """`add_weighted`'s sums back to per-depth means `d{k}/{name}` (for the depths with counted positions) and
    counts `d{k}/n`."""
    out: dict[str, float] = {}
    for k in range(1, depth + 1):
        n = int(sums[k - 1, 0])
        if n:
            out.update({f"d{k}/{key}": float(sums[k - 1, i] / n) for i, key in enumerate(names, start=1)})
        out[f"d{k}/n"] = n
    return out


def autocast_for(precision: str, device: torch.device):
    """`train.precision` as a context factory: bf16 autocast around the forward, or nothing for fp32."""
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def evaluate(head: DraftHead, frozen: FrozenTarget, batches, depth: int, loss_cfg: LossConfig, device,
             autocast, steps: int | None = None, filler=None, stats: TargetStats | None = None) -> dict[str, float]:
    """Teacher-forced validation metrics, weighted by counted positions over all batches of all ranks.

    `steps`: forward passes to make; past the end of this rank's batches `filler` (a batch) is computed and
    not counted (ZeRO-3 gathers parameters in every forward, so every rank must make the same number).
    `stats`: the val split's `TargetStats` (the trainer keeps one across its evaluations)."""
    names = metric_names(head, loss_cfg)
    sums = torch.zeros(depth, 1 + len(names), dtype=torch.float64)
    was_training = head.training
    head.eval()
    done = 0
    with torch.no_grad():
        draft = head.draft_lm_head(frozen.lm_head_weight)
        for batch in batches:
            _evaluate_batch(head, frozen, draft, batch, depth, loss_cfg, device, autocast, sums, names, stats)
            done += 1
        while steps is not None and done < steps:
            _evaluate_batch(head, frozen, draft, filler, depth, loss_cfg, device, autocast, None, names, stats)
            done += 1
    head.train(was_training)
    return averages(dist.all_reduce_sum(sums.to(device)).cpu(), depth, names)


def _evaluate_batch(head, frozen, draft, batch, depth, loss_cfg, device, autocast, sums, names, stats=None) -> None:
    batch = {k: v.to(device) for k, v in batch.items()}
    with autocast():
        outs = unrolled(head, frozen.embed, head_inputs(batch), batch["input_ids"], batch["lengths"], depth)
    _, m = head_loss([o.float() for o in outs], batch["hidden"], batch["loss_mask"], batch["lengths"],
                     frozen.lm_head_weight, loss_cfg, draft=draft, stats=stats, index=batch.get("index"))
    if sums is not None:
        add_weighted(sums, m, depth, names)


def format_eval(m: dict, depth: int) -> str:
    """One console line of an evaluation: each depth's acc and accept (and in_vocab with a draft vocabulary)."""
    return "  ".join(f"d{k} acc {m.get(f'd{k}/acc', 0):.3f} accept {m.get(f'd{k}/accept', 0):.3f}"
                     + (f" in_vocab {m[f'd{k}/in_vocab']:.3f}" if f"d{k}/in_vocab" in m else "")
                     for k in range(1, depth + 1))
