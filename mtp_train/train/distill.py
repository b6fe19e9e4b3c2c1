"""The distribution term of the training objective (`loss.py`): CE(q, p) of the draft's distribution q against the
target's p, with the LK term (`accept_weight`) and HASS's top-K term (`topk_weight`), over the full vocabulary or
a draft vocabulary; and the statistics of the target it needs.

The distribution term never holds [tokens × vocab] for a whole batch: `ChunkedDistill` walks the selected
positions in chunks, computes fp32 softmaxes, the loss, the metrics and the gradient with respect to ĥ
chunk by chunk in the forward pass, and keeps only that gradient ([tokens, H]) for backward. W is frozen,
so no gradient for it is formed. Softmaxes are fp32; with a bf16 W (GPU runs) the logits come out of a
bf16 matmul, so they carry bf16 rounding (~0.4% relative) before the fp32 softmax.

With a draft vocabulary (`head.draft_vocab`) the draft's logits are formed over its tokens only (the head's
`DraftLMHead`); the target's are still formed over the full vocabulary, for its argmax and for the expected
acceptance (`target_stats`). Every depth's rows then go through one `SharedTargetDistill` pass, chunked by target
position: the target's distribution over the draft vocabulary is formed once per position for all the depths
that read it.
"""

from __future__ import annotations

import torch


class ChunkedDistill(torch.autograd.Function):
    """sum_n weight_n · CE(q_n, p_n) over rows, plus metrics, over the full vocabulary (a draft vocabulary goes
    through `SharedTargetDistill`; `distill_ce` picks).

    Inputs: x [N, H] (the head's ĥ, needs grad), y [N, H] (the target's h_next), W [V, H] frozen, weight [N];
    q = softmax(W x), p = softmax(W y / T).
    Outputs: loss (scalar, differentiable in x), and per-row metrics [N, 3], not differentiable: top-1
    agreement of the draft's argmax with the target's; expected acceptance Σ_x min(p(x), q(x)); 1 (the
    target's argmax is always inside).
    """

    @staticmethod
    def forward(ctx, x, y, W, weight, temperature: float, chunk: int, accept_weight: float = 0.0,
                topk: tuple[float, int] = (0.0, 0)):
        N = x.shape[0]
        grad = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        metrics = torch.ones(N, 3, dtype=torch.float32, device=x.device)
        for s in range(0, N, chunk):
            xs, ys, ws = x[s:s + chunk], y[s:s + chunk], weight[s:s + chunk].float()
            part, g = _full_chunk(xs, ys, W, ws, temperature, metrics[s:s + chunk], accept_weight, topk)
            loss += part
            if grad is not None:
                grad[s:s + chunk] = g.to(x.dtype)
            del g
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics):
        (grad,) = ctx.saved_tensors
        return (None if grad is None else grad * grad_loss.float().to(grad.dtype)), *[None] * 7


class SharedTargetDistill(torch.autograd.Function):
    """Every depth's rows of a draft-vocabulary loss in one pass over the target positions they read.

    At depth j anchor i reads target position i+1+j, which anchor i+1 reads at depth j-1: the target's logits
    over the draft vocabulary (Wt y / T), its distribution renormalised over them and p_full are formed once per
    target position, chunk by chunk of positions, for every row (of any depth) that reads it, instead of once per
    row. `distill_ce` with a draft vocabulary is the case of one row per position.
    Inputs: x [N, H] (the rows of all depths, needs grad), pos [N] (each row's target position, an index into
    y), y [P, H] (the target's hidden states at those positions), weight [N] (each row's weight in the loss),
    top [P] / lse [P] (the positions' `target_stats`), Wd [M, H] (the draft's lm_head, frozen or trainable),
    ids [M], Wt [M, H] (W's rows for ids). Outputs: the loss Σ_n weight_n · kept_n · CE(q_n, p_n), and per-row
    metrics [N, 4], not differentiable: top-1 agreement with the target's full-vocabulary argmax, Σ min(p_full,
    q), kept (the target's argmax is a draft token), and the row's CE (0 when not kept). With `keep_outside` every
    row counts (kept_n = 1 in the loss and the CE; the metric still says whether the argmax is inside).
    """

    @staticmethod
    def forward(ctx, x, pos, y, weight, top, lse, Wd, ids, Wt, temperature: float, chunk: int,
                accept_weight: float = 0.0, keep_outside: bool = False, topk: tuple[float, int] = (0.0, 0)):
        N, P = x.shape[0], y.shape[0]
        grad = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_wd = torch.zeros(Wd.shape, dtype=torch.float32, device=Wd.device) if ctx.needs_input_grad[6] else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        metrics = torch.zeros(N, 4, dtype=torch.float32, device=x.device)
        inside = torch.zeros(int(ids.max()) + 1 if ids.numel() else 1, dtype=torch.bool, device=x.device)
        inside[ids] = True
        kept_at = (top < inside.shape[0]) & inside[top.clamp(max=inside.shape[0] - 1)]  # [P]
        counts_at = torch.ones_like(kept_at) if keep_outside else kept_at  # [P]: rows whose term counts
        order = torch.argsort(pos, stable=True)  # rows by target position: a chunk's rows are one range
        starts = torch.searchsorted(pos[order], torch.arange(0, P + chunk, chunk, device=pos.device)).tolist()
        for c, s in enumerate(range(0, P, chunk)):
            a, b = starts[c], starts[c + 1]
            if a == b:
                continue
            rows = order[a:b]
            local = pos[rows] - s
            p = (y[s:s + chunk].to(Wt.dtype) @ Wt.T).float()  # the target's logits over the draft vocabulary
            if temperature != 1.0:
                p.div_(temperature)
            p_sub = _softmax_(p.clone())[local]  # per row: the target renormalised over the draft vocabulary
            p_full = p.sub_(lse[s:s + chunk, None]).exp_()[local]  # per row: p_full over the draft vocabulary
            del p
            kept, counts = kept_at[s:s + chunk][local], counts_at[s:s + chunk][local]
            xs = x[rows]
            d = (xs.to(Wd.dtype) @ Wd.T).float()  # draft logits [n, M]
            metrics[rows, 0] = (ids[d.argmax(-1)] == top[s:s + chunk][local]).float()
            metrics[rows, 2] = kept.float()
            d.sub_(d.logsumexp(-1, keepdim=True))  # log q
            ce = -(p_sub.unsqueeze(1) @ d.unsqueeze(2)).view(-1) * counts
            metrics[rows, 3] = ce
            ws = weight[rows].float() * counts
            top_term, top_grad = _topk_term(d, p_sub, *topk) if topk[0] else (0.0, None)  # HASS; d is log q
            d.exp_()  # q
            if accept_weight:  # the LK term; α = Σ min(p_full, q), q = 0 outside
                term, metrics[rows, 1] = _with_accept_term(d, p_sub, p_full, ce, accept_weight)
                loss += (ws * (term + top_term)).sum()
            else:
                loss += (ws * (ce + top_term)).sum()
                metrics[rows, 1] = torch.minimum(p_full, d, out=p_full).sum(-1)  # Σ min(p_full, q); q = 0 outside
                d.sub_(p_sub)  # d CE / d draft logits
            del p_full, p_sub
            if top_grad is not None:
                d.add_(top_grad)
                del top_grad
            d.mul_(ws[:, None])  # weighted d loss / d draft logits
            if grad_wd is not None:
                grad_wd += d.T @ xs.float()
            if grad is not None:
                grad[rows] = (d.to(Wd.dtype) @ Wd).to(x.dtype)
            del d
        ctx.wd_dtype = Wd.dtype
        ctx.save_for_backward(grad, grad_wd)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics):
        grad, grad_wd = ctx.saved_tensors
        scale = grad_loss.float()
        return (None if grad is None else grad * scale.to(grad.dtype)), None, None, None, None, None, \
            (None if grad_wd is None else (grad_wd * scale).to(ctx.wd_dtype)), *[None] * 7


def _softmax_(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) over the last dim, in place (fp32)."""
    if temperature != 1.0:
        logits.div_(temperature)
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(-1, keepdim=True))


ACCEPT_FLOOR = 1e-4  # -log α divides its gradient by max(α, this): a row the draft misses entirely stays bounded


def _accept_term(q: torch.Tensor, p: torch.Tensor):
    """The LK term of rows q [n, M] (the draft's distribution) against p [n, M] (the target's probabilities of
    the same tokens, p_full: over a draft vocabulary they sum to below 1): (-log α [n], its gradient with
    respect to the draft's logits [n, M], α [n]), α = Σ min(p, q), the chance that a token drawn from q is
    accepted at T = 1. dα/dz_k = q_k (1[q_k < p_k] - A), A = Σ_{x: q_x < p_x} q_x: raising the logit of a token
    the draft under-weights buys acceptance, less the mass it takes from the other under-weighted tokens. One
    [n, M] buffer besides q and p, which are left as they are."""
    under = (q < p).to(q.dtype)  # tokens where raising q raises α
    a = (under.unsqueeze(1) @ q.unsqueeze(2)).view(-1)  # Σ_under q
    alpha = a + p.sum(-1) - (under.unsqueeze(1) @ p.unsqueeze(2)).view(-1)  # Σ_under q + Σ_rest p
    floored = alpha.clamp_min(ACCEPT_FLOOR)
    grad = under.sub_(a[:, None]).mul_(q).div_(-floored[:, None])  # d(-log α) / dz
    return -floored.log(), grad, alpha


def _with_accept_term(q: torch.Tensor, p: torch.Tensor, p_full: torch.Tensor, ce: torch.Tensor, w: float):
    """The LK loss's rows, (1 - w) CE + w (-log α), from the draft's distribution q [n, M], the target's
    distribution p that the CE reads and p_full, its probabilities of the same tokens that α reads (p itself over
    the full vocabulary), and the rows' CE [n]. Turns q in place into the rows' gradient with respect to the draft's
    logits; returns (the rows' terms [n], α [n])."""
    lk, lk_grad, alpha = _accept_term(q, p_full)
    q.sub_(p).mul_(1 - w).add_(lk_grad, alpha=w)
    return (1 - w) * ce + w * lk, alpha


def _topk_term(log_q: torch.Tensor, p: torch.Tensor, weight: float, k: int):
    """HASS's top-K distillation for rows of log q [n, M] against p [n, M] (the distribution the CE reads): the
    rows' weight · (-Σ_{x in top-k(p)} p_x log q_x) [n] and its gradient with respect to the draft's logits [n, M],
    weight · (P q - p on the top k), P = Σ_{top k} p. One [n, M] buffer."""
    idx = p.topk(min(k, p.shape[-1]), -1).indices
    p_top = p.gather(-1, idx)
    term = -(p_top * log_q.gather(-1, idx)).sum(-1)
    grad = log_q.exp().mul_(p_top.sum(-1, keepdim=True)).scatter_add_(-1, idx, -p_top).mul_(weight)
    return weight * term, grad


def _full_chunk(xs, ys, W, ws, temperature, metrics, accept_weight: float = 0.0,
                topk: tuple[float, int] = (0.0, 0)):
    """One chunk over the full vocabulary: two [n, V] fp32 buffers (three with the LK term or the top-K one),
    transformed in place. Fills metrics[:, :2]; returns the chunk's weighted loss and its gradient with respect to
    xs."""
    p = (ys.to(W.dtype) @ W.T).float()  # target logits [n, V]
    top_p = p.argmax(-1)
    _softmax_(p, temperature)  # p = softmax(W y / T)
    d = (xs.to(W.dtype) @ W.T).float()  # draft logits [n, V]
    metrics[:, 0] = (d.argmax(-1) == top_p).float()
    d.sub_(d.logsumexp(-1, keepdim=True))  # log q
    term = -(p.unsqueeze(1) @ d.unsqueeze(2)).view(-1)  # CE: Σ p log q without a temporary
    top_term, top_grad = _topk_term(d, p, *topk) if topk[0] else (0.0, None)  # HASS; d is log q
    if accept_weight:
        term, metrics[:, 1] = _with_accept_term(d.exp_(), p, p, term, accept_weight)
    else:
        d.exp_().sub_(p)  # q - p = d CE / d logits (Σp = 1)
        metrics[:, 1] = 1 - 0.5 * torch.linalg.vector_norm(d, ord=1, dim=-1)  # Σ min(p, q)
    if top_grad is not None:
        d.add_(top_grad)
    return (ws * (term + top_term)).sum(), d.mul_(ws[:, None]).to(W.dtype) @ W  # chain through x @ W.T


def target_stats(y: torch.Tensor, W: torch.Tensor, temperature: float, chunk: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of target hidden states y [P, H]: the full-vocabulary argmax of W y [P] and logsumexp(W y / T)
    [P] (fp32), chunked (one [chunk, V] buffer). With them a draft-vocabulary loss needs only the draft
    vocabulary's rows of W: p_full(x) = exp((W y)_x / T - lse) for x inside."""
    top = torch.empty(y.shape[0], dtype=torch.long, device=y.device)
    lse = torch.empty(y.shape[0], dtype=torch.float32, device=y.device)
    with torch.no_grad():
        for s in range(0, y.shape[0], chunk):
            logits = (y[s:s + chunk].to(W.dtype) @ W.T).float()
            top[s:s + chunk] = logits.argmax(-1)
            if temperature != 1.0:
                logits.div_(temperature)
            top_logit = logits.amax(-1, keepdim=True)  # logsumexp in place: half torch.logsumexp's time here
            lse[s:s + chunk] = logits.sub_(top_logit).exp_().sum(-1).log_().add_(top_logit[:, 0])
            del logits
    return top, lse


def distill_ce(x, y, W, weight, temperature: float = 1.0, chunk: int = 1024, Wd=None, ids=None, Wt=None,
               accept_weight: float = 0.0, keep_outside: bool = False, topk: tuple[float, int] = (0.0, 0)):
    """The distribution term of rows x [N, H] against target states y [N, H]: over the full vocabulary
    (`ChunkedDistill`), or with a draft vocabulary (`ids`, the draft's lm_head `Wd`, trainable or W's rows, and
    `Wt`, W's rows of the draft vocabulary when `Wd` is the head's own) through `SharedTargetDistill`, each row
    reading its own target position (`keep_outside`: rows whose target argmax is outside it count too).
    -> (loss, per-row metrics [N, 3]: acc, accept, in_vocab)."""
    if ids is None:
        if Wd is not None and Wd.requires_grad:
            raise NotImplementedError("a trainable lm_head is supported over a draft vocabulary (ids) only")
        return ChunkedDistill.apply(x, y, W, weight, temperature, chunk, accept_weight, topk)
    top, lse = target_stats(y, W, temperature, chunk)
    pos = torch.arange(x.shape[0], device=x.device)
    loss, metrics = SharedTargetDistill.apply(x, pos, y, weight, top, lse, Wd, ids, Wd if Wt is None else Wt,
                                              temperature, chunk, accept_weight, keep_outside, topk)
    return loss, metrics[:, :3]


def draft_holds(x: torch.Tensor, Wd: torch.Tensor, ids: torch.Tensor | None, top: torch.Tensor, k: int,
                chunk: int) -> torch.Tensor:
    """[n] bool: whether the draft's top-k tokens for rows x [n, H] (its logits x Wd^T over its vocabulary; `ids`
    [M] maps them to target ids, None when Wd is the full lm_head) hold the target id `top` [n]. No gradient."""
    out = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    k = min(k, Wd.shape[0])
    with torch.no_grad():
        for s in range(0, x.shape[0], chunk):
            cand = (x[s:s + chunk].to(Wd.dtype) @ Wd.T).float().topk(k, -1).indices
            if ids is not None:
                cand = ids[cand]
            out[s:s + chunk] = (cand == top[s:s + chunk, None]).any(-1)
    return out
