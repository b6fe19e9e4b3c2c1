"""The training objective (DESIGN §4), one module for every head variant.

Per masked position and depth j (weight γ^j):  w_feat · SmoothL1(ĥ, h_next) + w_logit · CE(q, p),
q = softmax(W ĥ), p = softmax(W h_next / T) recomputed from the stored hidden state through the frozen W.

The distribution term never holds [tokens × vocab] for a whole batch: `ChunkedDistill` walks the selected
positions in chunks, computes fp32 softmaxes, the loss, the metrics and the gradient with respect to ĥ
chunk by chunk in the forward pass, and keeps only that gradient ([tokens, H]) for backward. W is frozen,
so no gradient for it is formed. Softmaxes are fp32; with a bf16 W (GPU runs) the logits come out of a
bf16 matmul, so they carry bf16 rounding (~0.4% relative) before the fp32 softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossConfig:
    w_feat: float = 0.1  # SmoothL1 on the hidden state (EAGLE's regression term)
    w_logit: float = 1.0  # CE against the target's own distribution
    temperature: float = 1.0  # of the target distribution p
    gamma: float = 0.8  # depth j weighs gamma**j
    chunk_tokens: int = 1024  # positions per softmax chunk (peak memory ~ chunk_tokens x vocab x 4 bytes x 4)

    def __post_init__(self) -> None:
        if self.w_feat < 0 or self.w_logit < 0 or self.w_feat + self.w_logit == 0:
            raise ValueError(f"loss.w_feat={self.w_feat}, loss.w_logit={self.w_logit}: both must be >= 0, "
                             "not both 0")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature={self.temperature}: must be > 0")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"loss.gamma={self.gamma}: must be in (0, 1]")
        if self.chunk_tokens < 1:
            raise ValueError(f"loss.chunk_tokens={self.chunk_tokens}: must be >= 1")


class ChunkedDistill(torch.autograd.Function):
    """sum_n weight_n · CE(softmax(W x_n), softmax(W y_n / T)) over rows, plus metrics.

    Inputs: x [N, H] (the head's ĥ, needs grad), y [N, H] (the target's h_next), W [V, H] frozen, weight [N].
    Outputs: loss (scalar, differentiable in x), and per-row metrics [N, 2] (top-1 agreement with the
    target's argmax, expected acceptance Σ min(p, q)), not differentiable.
    """

    @staticmethod
    def forward(ctx, x, y, W, weight, temperature: float, chunk: int):
        N = x.shape[0]
        grad = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        metrics = torch.zeros(N, 2, dtype=torch.float32, device=x.device)
        for s in range(0, N, chunk):  # two [n, V] fp32 buffers per chunk, transformed in place
            xs, ys, ws = x[s:s + chunk], y[s:s + chunk], weight[s:s + chunk].float()
            p = (ys.to(W.dtype) @ W.T).float()  # target logits [n, V]
            top_p = p.argmax(-1)
            p.div_(temperature)
            p.sub_(p.amax(-1, keepdim=True)).exp_()
            p.div_(p.sum(-1, keepdim=True))  # p = softmax(W y / T)
            d = (xs.to(W.dtype) @ W.T).float()  # draft logits [n, V]
            metrics[s:s + chunk, 0] = (d.argmax(-1) == top_p).float()
            d.sub_(d.logsumexp(-1, keepdim=True))  # log q
            loss -= (ws * (p.unsqueeze(1) @ d.unsqueeze(2)).view(-1)).sum()  # Σ p log q without a temporary
            d.exp_().sub_(p)  # q - p = d CE / d logits (Σp = 1)
            metrics[s:s + chunk, 1] = 1 - 0.5 * torch.linalg.vector_norm(d, ord=1, dim=-1)  # Σ min(p, q)
            if grad is not None:  # chain through x @ W.T
                grad[s:s + chunk] = (d.mul_(ws[:, None]).to(W.dtype) @ W).to(x.dtype)
            del p, d
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics):
        (grad,) = ctx.saved_tensors
        return (None if grad is None else grad * grad_loss.to(grad.dtype)), None, None, None, None, None


def distill_ce(x, y, W, weight, temperature: float = 1.0, chunk: int = 1024):
    return ChunkedDistill.apply(x, y, W, weight, temperature, chunk)


def predicted_mask(loss_mask: torch.Tensor, lengths: torch.Tensor, depth_index: int) -> torch.Tensor:
    """[B, T] bool: anchor i at depth j predicts x_{i+2+j}; it counts when that token exists and is trainable."""
    B, T = loss_mask.shape
    n = 2 + depth_index
    pos = torch.arange(T, device=loss_mask.device)[None]
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    if T > n:
        out[:, :-n] = loss_mask[:, n:].bool()
    return out & (pos + n < lengths[:, None])


def counted_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, depth: int) -> list[int]:
    """Positions that count at each depth 1..depth (what `head_loss` divides by when not told otherwise)."""
    return [int(predicted_mask(loss_mask, lengths, j).sum()) for j in range(depth)]


def head_loss(outputs: list[torch.Tensor], hidden: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
              W: torch.Tensor, cfg: LossConfig, ce=None, norm: list[int] | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss over depths for one batch, and its per-depth metrics.

    outputs[j] [B, T, H] is ĥ at depth j (from `model.head.unrolled`), hidden [B, T, H] the target's h,
    loss_mask [B, T] trainable tokens, lengths [B]. Each depth's terms are sums over its counted positions
    divided by `norm[j]`: by default this batch's own count (a mean); the trainer passes the count of the
    whole optimizer step (every micro-batch on every rank), so that every counted position weighs the same
    and the step's loss is the sum of its micro-batches' losses, however they are spread over ranks.
    Metrics: `d{k}/{feat,ce,acc,accept,n}` for depth k = j + 1 (1 = the first drafted token): means over
    this batch's counted positions and their count; and `loss`, the returned loss. `ce` replaces `distill_ce`
    (same signature; the train-step benchmark passes a full-logits implementation to compare against).
    """
    ce_fn = ce or distill_ce
    # zero that still depends on the head: a batch with nothing to count backpropagates zeros, not an error
    total = sum(o.sum() for o in outputs).float() * 0.0
    metrics: dict[str, float] = {}
    for j, h_hat in enumerate(outputs):
        sel = predicted_mask(loss_mask, lengths, j)
        n = int(sel.sum())
        key = f"d{j + 1}"
        metrics[f"{key}/n"] = n
        if n == 0:
            continue
        denom = n if norm is None else norm[j]
        if denom < n:
            raise ValueError(f"head_loss: norm[{j}]={denom} is below this batch's {n} counted positions")
        shift = 1 + j
        target = torch.zeros_like(hidden)
        target[:, :-shift] = hidden[:, shift:]  # h_{i+1+j}
        x, y = h_hat[sel], target[sel]  # [n, H]
        feat_sum = F.smooth_l1_loss(x.float(), y.float(), reduction="none").mean(-1).sum()
        ce_sum, per_row = ce_fn(x, y, W, x.new_full((n,), 1.0 / denom), cfg.temperature, cfg.chunk_tokens)
        total = total + cfg.gamma ** j * (cfg.w_feat * (feat_sum / denom) + cfg.w_logit * ce_sum)
        metrics[f"{key}/feat"] = (feat_sum / n).item()
        metrics[f"{key}/ce"] = ce_sum.item() if denom == n else ce_sum.item() * denom / n
        metrics[f"{key}/acc"] = per_row[:, 0].mean().item()
        metrics[f"{key}/accept"] = per_row[:, 1].mean().item()
    metrics["loss"] = total.item()
    return total, metrics
