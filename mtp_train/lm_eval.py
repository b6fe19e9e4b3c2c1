"""Held-out next-token metrics for a causal LM, and the unigram baseline they are judged against."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass
class LMMetrics:
    tokens: int  # predicted positions scored
    loss: float  # mean cross-entropy, nats per token
    top1: float  # fraction of positions whose argmax is the next token

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def as_dict(self) -> dict:
        return {**asdict(self), "perplexity": self.perplexity}


def windows(ids: list[int] | torch.Tensor, length: int, max_windows: int | None = None) -> torch.Tensor:
    """Cut a token stream into non-overlapping `[n, length]` windows (the tail that does not fill one is
    dropped)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    n = ids.numel() // length
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * length].view(n, length)


@torch.inference_mode()
def next_token_metrics(model: torch.nn.Module, batches: torch.Tensor, batch_size: int = 8) -> LMMetrics:
    """Loss and top-1 accuracy of `model` predicting token t+1 from tokens ≤ t in every window."""
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, batches.shape[0], batch_size):
        x = batches[start : start + batch_size].to(device)
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        target = x[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
        total_loss += loss.item()
        correct += (logits.argmax(-1) == target).sum().item()
        count += target.numel()
    if count == 0:
        raise ValueError("no tokens to score: the evaluation windows are empty")
    return LMMetrics(tokens=count, loss=total_loss / count, top1=correct / count)


def unigram_metrics(train_ids: torch.Tensor, batches: torch.Tensor, vocab_size: int) -> LMMetrics:
    """The unigram baseline: token frequencies counted on `train_ids` (add-one smoothed), scored on the
    same positions `next_token_metrics` scores in `batches`."""
    counts = torch.bincount(torch.as_tensor(train_ids).long().flatten(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    target = batches[:, 1:].reshape(-1)
    loss = -logp[target].mean().item()
    top1 = (target == counts.argmax()).double().mean().item()
    return LMMetrics(tokens=target.numel(), loss=loss, top1=top1)
