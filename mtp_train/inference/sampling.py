"""Turning logits into tokens, and deciding which drafted tokens the target keeps.

One module for the draft and the target: the same temperature / top-k / top-p processing makes both the
draft distribution q and the target distribution p, so the speculative output follows exactly the
processed target distribution that plain sampling would draw from.

Verification, for k drafted tokens d_1..d_k and the target's distributions p_1..p_{k+1} along them:

* greedy (temperature 0): keep drafts while d_j == argmax p_j; the first mismatch is replaced by the
  target's argmax there, and when all k match the target's argmax at k+1 is appended (the bonus token).
  The output is token for token what greedy decoding of the target alone emits.
* sampled (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding"): keep d_j with
  probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from norm(max(p_j - q_j, 0)); when
  all k are kept draw the bonus from p_{k+1}. Each emitted token is then distributed as p, whatever q is.

Both take `num_drafts [B]`: rows may verify fewer drafts than the batch's k (a row near its length limit).
Positions past a row's count are treated as drafts with q = 0: never kept, and the next token is drawn
from p there, which is what the target alone would do.
"""

from __future__ import annotations

import torch

from mtp_train.inference.config import SamplingConfig


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> the distribution tokens are drawn from [..., V], fp32: softmax(logits / T) with
    the top-k and top-p cuts applied and renormalized. Greedy gives the one-hot of the argmax."""
    logits = logits.float()
    if cfg.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, before >= cfg.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [..., V] -> tokens [...]: the argmax when greedy, else a draw from `probabilities`."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample(probabilities(logits, cfg), generator)


def _drafted(num_drafts: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k]: position j holds a real draft of that row."""
    return torch.arange(k, device=num_drafts.device)[None, :] < num_drafts[:, None]


def _leading(kept: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B]: how many leading positions are True."""
    return kept.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k], target_logits [B, k+1, V] (the target's logits after the pending token and after each
    draft) -> (accepted [B] in 0..k, next [B]: the target's argmax after the accepted drafts)."""
    B, k = drafts.shape
    num_drafts = torch.full((B,), k, device=drafts.device) if num_drafts is None else num_drafts
    best = target_logits.argmax(-1)  # [B, k+1]
    accepted = _leading((drafts == best[:, :k]) & _drafted(num_drafts, k))
    return accepted, best.gather(1, accepted[:, None]).squeeze(1)


def verify_sampled(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   num_drafts: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling. drafts [B, k] drawn from draft_probs q [B, k, V]; target_probs p [B, k+1, V],
    both full (processed) distributions -> (accepted [B] in 0..k, next [B])."""
    B, k = drafts.shape
    num_drafts = torch.full((B,), k, device=drafts.device) if num_drafts is None else num_drafts
    p_d = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # p_j(d_j) [B, k]
    q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)  # q_j(d_j)
    u = torch.rand(B, k, generator=generator, device=drafts.device)
    accepted = _leading((u * q_d < p_d) & _drafted(num_drafts, k))  # u < p/q, i.e. prob min(1, p/q)
    rows = torch.arange(B, device=drafts.device)
    p = target_probs[rows, accepted]  # [B, V]: the target's distribution after the accepted prefix
    q = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, draft_probs.shape[-1])], dim=1)[rows, accepted]
    q = q * (accepted < num_drafts)[:, None]  # past the drafts (all kept): q = 0, the bonus comes from p
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p <= q everywhere means p == q, where a rejection has probability 0; fall back to p for rounding
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p)
    return accepted, sample(residual, generator)
