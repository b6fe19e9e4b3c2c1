"""The training objective (DESIGN §4), one module for every head variant.

Per masked position and depth j (weight γ^j):  w_feat · SmoothL1(ĥ, h_next) + w_logit · CE(q, p),
q = softmax(W ĥ), p = softmax(W h_next / T) recomputed from the stored hidden state through the frozen W.
With `accept_weight` w > 0 (the LK loss) the CE becomes (1 - w) · CE(q, p) + w · (-log Σ min(p, q)).
With `topk_weight` w_k > 0 (HASS's top-K distillation, arXiv 2408.15766) a row's term adds
w_k · (-Σ_{x ∈ top-K(p)} p(x) log q(x)): the target's K likeliest tokens weigh (1 + w_k) times.
With `align_topk` k > 0 (GRIFFIN's token-alignable loss mask, arXiv 2502.11018) an anchor's row at depth j has
terms only while the draft's top-k held the target's argmax at every earlier depth: the chains decoding reaches.

The distribution term never holds [tokens × vocab] for a whole batch: `ChunkedDistill` walks the selected
positions in chunks, computes fp32 softmaxes, the loss, the metrics and the gradient with respect to ĥ
chunk by chunk in the forward pass, and keeps only that gradient ([tokens, H]) for backward. W is frozen,
so no gradient for it is formed. Softmaxes are fp32; with a bf16 W (GPU runs) the logits come out of a
bf16 matmul, so they carry bf16 rounding (~0.4% relative) before the fp32 softmax.

With a draft vocabulary (`head.draft_vocab`) the draft's logits are formed over its tokens only (the head's
`DraftLMHead`); the target's are still formed over the full vocabulary once per sample, for its argmax and for
the expected acceptance (`TargetStats`, kept across epochs), so the metrics mean what they mean for a
full-vocabulary head (see `head_loss`). Every depth's rows then go through one `SharedTargetDistill` pass,
chunked by target position: the target's distribution over the draft vocabulary is formed once per position for
all the depths that read it.
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
    # LK loss (arXiv 2602.23881, its negative log-acceptance form): a row's distribution term is
    # (1 - w) · CE(q, p) + w · (-log α), α = Σ_x min(p_full(x), q(x)), the expected acceptance of the draft
    # token at T = 1; 0 is the soft cross-entropy alone, 1 the acceptance alone
    accept_weight: float = 0.0
    # over a draft vocabulary, the positions whose target argmax is outside it: "drop" (no distribution term; EAGLE-3's
    # and SpecForge's choice) or "renormalise" (the term against the target renormalised over the draft vocabulary,
    # like every other position; speculators' choice). Either way they stay in the denominator and the metrics
    out_of_vocab: str = "drop"
    # GRIFFIN's token-alignable training (arXiv 2502.11018): with k > 0 an anchor's row at depth j >= 2 has no term
    # (feature or distribution) unless the draft's top-k at each earlier depth held the target's argmax, i.e. unless
    # decoding that keeps k candidates a step could have reached it (1: a chain under greedy verification; GRIFFIN
    # trains with 3 for trees). Rows it drops stay in the denominator and in the metrics; `d{k}/reached` is the
    # share of a depth's rows that count. 0: every row counts (EAGLE-3's TTT)
    align_topk: int = 0
    # HASS's harmonized objective distillation (arXiv 2408.15766): each row's distribution term adds
    # topk_weight · (-Σ_{x in the target's top-`topk`} p(x) log q(x)), so the tokens that decide acceptance weigh more
    # than the tail the full CE also fits. 0 is off; HASS uses K = 10
    topk_weight: float = 0.0
    topk: int = 10

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
        if not 0 <= self.accept_weight <= 1:
            raise ValueError(f"loss.accept_weight={self.accept_weight}: must be in [0, 1]")
        if self.out_of_vocab not in OUT_OF_VOCAB:
            raise ValueError(f"loss.out_of_vocab={self.out_of_vocab!r}: must be one of {', '.join(OUT_OF_VOCAB)}")
        if self.topk_weight < 0 or self.topk < 1:
            raise ValueError(f"loss.topk_weight={self.topk_weight}, loss.topk={self.topk}: must be >= 0 and >= 1")
        if self.align_topk < 0:
            raise ValueError(f"loss.align_topk={self.align_topk}: must be >= 0 (0 is off)")


OUT_OF_VOCAB = ("drop", "renormalise")


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


def needed_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, T] bool: the target positions whose hidden state some counted anchor reads, at any depth 1..depth
    (anchor i reads h_{i+1+j} at depth j). A sample's own: it depends on its mask and length only."""
    T = loss_mask.shape[1]
    need = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    for j in range(depth):
        w = max(0, T - 1 - j)  # anchors whose target position exists
        need[:, 1 + j:1 + j + w] |= predicted_mask(loss_mask, lengths, j)[:, :w]
    return need


class TargetStats:
    """The target's full-vocabulary argmax and logsumexp(W h / T) at the positions the loss reads, per sample.

    They are the one full-vocabulary matmul of a draft-vocabulary step ([positions, V]: 0.66 s of a 2.48 s eagle3
    step on SmolLM2 at 8 samples, depth 3, on 2 CPU cores), and a function of the sample alone: the store's hidden states, the frozen W, T. So they are
    computed sample by sample (the same rows in the same order whatever batch a sample lands in, hence the same
    bits) and, with `max_mb` > 0 and the batch's sample indices, kept for the sample's next visit: from the
    second epoch on a step skips them. A cached value equals a recomputed one bit for bit, so a resumed run (which
    starts with an empty cache) matches an uninterrupted one. Only for sources whose hidden states are the
    same on every visit (the store; not online features, which the trainer does not cache).
    """

    def __init__(self, W: torch.Tensor, temperature: float, chunk: int, max_mb: float = 0.0):
        self.W, self.temperature, self.chunk = W, temperature, chunk
        self.max_bytes = int(max_mb * 2**20)
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sample -> (top int32 [n], lse fp32 [n])
        self.bytes = 0
        self.hits = self.misses = 0

    def __call__(self, hidden: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, depth: int,
                 index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """top [B, T] (long) and lse [B, T] (fp32), set at `needed_positions` (elsewhere 0)."""
        B, T = loss_mask.shape
        top = torch.zeros(B, T, dtype=torch.long, device=hidden.device)
        lse = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
        need = needed_positions(loss_mask, lengths, depth)
        for b in range(B):
            n = int(lengths[b])
            key = None if index is None or not self.max_bytes else int(index[b])
            got = self.kept.get(key) if key is not None else None
            if got is not None and got[0].shape[0] == n:
                self.hits += 1
                top[b, :n], lse[b, :n] = got[0].to(top.device), got[1].to(lse.device)
                continue
            self.misses += 1
            rows = need[b].nonzero(as_tuple=True)[0]
            t, l = target_stats(hidden[b, rows], self.W, self.temperature, self.chunk)
            top[b, rows], lse[b, rows] = t, l
            if key is not None and self.bytes + 8 * n <= self.max_bytes:
                self.kept[key] = (top[b, :n].to("cpu", torch.int32), lse[b, :n].cpu())
                self.bytes += 8 * n
        return top, lse


def head_loss(outputs: list[torch.Tensor], hidden: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
              W: torch.Tensor, cfg: LossConfig, ce=None, norm: list[int] | None = None, draft=None,
              stats: "TargetStats | None" = None, index: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss over depths for one batch, and its per-depth metrics.

    outputs[j] [B, T, H] is ĥ at depth j (from `model.head.unrolled`), hidden [B, T, H] the target's h,
    loss_mask [B, T] trainable tokens, lengths [B]. Each depth's terms are sums over its counted positions
    divided by `norm[j]`: by default this batch's own count (a mean); the trainer passes the count of the
    whole optimizer step (every micro-batch on every rank), so that every counted position weighs the same
    and the step's loss is the sum of its micro-batches' losses, however they are spread over ranks.
    Metrics: `d{k}/{feat,ce,acc,accept,n}` for depth k = j + 1 (1 = the first drafted token): means over
    this batch's counted positions and their count; and `loss`, the returned loss. `ce` replaces `distill_ce`
    (same signature and per-row metrics, column 0 the top-1 agreement, which `align_topk=1` reads; the train-step
    benchmark passes a full-logits implementation to compare against).

    `draft` is the head's `DraftLMHead` (`DraftHead.draft_lm_head(W)`); with a draft vocabulary the CE is
    against the target renormalised over it, and positions whose target argmax is outside count as zero
    loss (still in the denominator), or, with `cfg.out_of_vocab="renormalise"`, like any other. The metrics stay
    comparable with a full-vocabulary head: `acc` is the draft argmax (as a target id) against the target's
    full-vocabulary argmax, `accept` Σ min(p_full, q) with q zero outside the draft vocabulary, both over all
    counted positions; `d{k}/in_vocab` is the fraction of counted positions whose target argmax is inside.
    Those need the target's full-vocabulary argmax and logsumexp at every position the loss reads: `stats` (a
    `TargetStats`, built from `W` and `cfg` when not given) computes them per sample and, given the batch's sample
    `index` [B], keeps them for the next epoch.

    With `cfg.align_topk` k > 0 a row of depth j >= 2 has terms only when its anchor's draft at every earlier depth
    held the target's argmax in its top-k (`draft_holds`); `d{k}/reached` is the share of depth k's rows that do,
    and `d{k}/ce` is over those rows (the other metrics stay over all counted positions).
    """
    ce_fn = ce or distill_ce
    sub = draft is not None and draft.ids is not None
    keep_outside = sub and cfg.out_of_vocab == "renormalise"  # rows whose target argmax is outside count too
    extra = (draft.weight, draft.ids) if sub else ()
    own = {"Wt": draft.target_rows} if sub and draft.target_rows is not None else {}  # eagle3: its own lm_head
    sels = [predicted_mask(loss_mask, lengths, j) for j in range(len(outputs))]
    T = loss_mask.shape[1]
    shared = sub and ce is None  # every depth in one pass over the target positions (SharedTargetDistill)
    if shared:
        # each target position's full-vocabulary argmax and logsumexp, once: at depth j anchor i reads h_{i+1+j},
        # the same h that anchor i+1 reads at depth j-1
        stats = stats or TargetStats(W, cfg.temperature, cfg.chunk_tokens)
        top, lse = stats(hidden, loss_mask, lengths, len(outputs), index)
        need = needed_positions(loss_mask, lengths, len(outputs))
        at = need.nonzero(as_tuple=True)
        slot = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
        slot[at] = torch.arange(at[0].shape[0], device=need.device)
        rows_x, rows_pos, rows_w, counted = [], [], [], []
    align = cfg.align_topk > 0
    reach = torch.ones(loss_mask.shape, dtype=torch.bool, device=loss_mask.device) if align else None
    # zero that still depends on the head: a batch with nothing to count backpropagates zeros, not an error
    total = sum(o.sum() for o in outputs).float() * 0.0
    metrics: dict[str, float] = {}
    for j, h_hat in enumerate(outputs):
        sel = sels[j]
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
        feat_rows = F.smooth_l1_loss(x.float(), y.float(), reduction="none").mean(-1)
        metrics[f"{key}/feat"] = (feat_rows.sum() / n).item()
        kept = reach[sel] if align else None  # the rows whose chain decoding reaches (align_topk)
        feat_sum = feat_rows.sum() if kept is None else (feat_rows * kept).sum()
        if align:
            metrics[f"{key}/reached"] = kept.float().mean().item()
        w = max(0, T - 1 - j)  # anchors whose target position exists (sel is False past them)
        if shared:
            rows_x.append(x)
            rows_pos.append(slot[:, 1 + j:1 + j + w][sel[:, :w]])
            rows_w.append(torch.full((n,), cfg.gamma ** j * cfg.w_logit / denom, device=x.device)
                          if kept is None else kept.float() * (cfg.gamma ** j * cfg.w_logit / denom))
            counted.append((key, n, kept))
            total = total + cfg.gamma ** j * cfg.w_feat * (feat_sum / denom)
        going_on = align and j + 1 < len(outputs)  # which anchors' chains go on to the next depth
        if going_on and shared:  # depth j + 1's rows must be known before the single pass over every depth
            holds = draft_holds(x.detach(), draft.weight, draft.ids, top[:, 1 + j:1 + j + w][sel[:, :w]],
                                cfg.align_topk, cfg.chunk_tokens)
            reach = torch.zeros_like(reach)
            reach[sel] = holds & kept
        if shared:
            continue
        lk = {"accept_weight": cfg.accept_weight} if cfg.accept_weight else {}  # a `ce` replacement may not take it
        if keep_outside:
            lk["keep_outside"] = True
        if cfg.topk_weight:
            lk["topk"] = (cfg.topk_weight, cfg.topk)
        weight = x.new_full((n,), 1.0 / denom) if kept is None else kept.to(x.dtype) / denom
        ce_sum, per_row = ce_fn(x, y, W, weight, cfg.temperature, cfg.chunk_tokens, *extra, **own, **lk)
        total = total + cfg.gamma ** j * (cfg.w_feat * (feat_sum / denom) + cfg.w_logit * ce_sum)
        n_kept = n if kept is None else max(1, int(kept.sum()))
        metrics[f"{key}/ce"] = ce_sum.item() if denom == n_kept else ce_sum.item() * denom / n_kept
        metrics[f"{key}/acc"] = per_row[:, 0].mean().item()
        metrics[f"{key}/accept"] = per_row[:, 1].mean().item()
        if sub:
            metrics[f"{key}/in_vocab"] = per_row[:, 2].mean().item()
        if going_on:
            # top-1: the CE's own agreement column (the draft's argmax, as a target id, against the target's
            # full-vocabulary argmax) is the test, and no second pass over the vocabulary is made
            holds = per_row[:, 0] > 0.5 if cfg.align_topk == 1 else draft_holds(
                x.detach(), draft.weight if sub else W, draft.ids if sub else None,
                target_stats(y, W, cfg.temperature, cfg.chunk_tokens)[0], cfg.align_topk, cfg.chunk_tokens)
            reach = torch.zeros_like(reach)
            reach[sel] = holds & kept
    if shared and counted:
        # a chunk of c positions is read by up to depth x c rows: chunk_tokens // depth positions keep the peak
        loss, per_row = SharedTargetDistill.apply(
            torch.cat(rows_x), torch.cat(rows_pos), hidden[at], torch.cat(rows_w), top[at], lse[at], draft.weight,
            draft.ids, draft.target_weight, cfg.temperature, max(1, cfg.chunk_tokens // len(outputs)),
            cfg.accept_weight, keep_outside, (cfg.topk_weight, cfg.topk))
        total = total + loss
        for (key, n, kept), part in zip(counted, per_row.split([n for _, n, _ in counted])):
            means = part.mean(0).tolist()
            metrics[f"{key}/acc"], metrics[f"{key}/accept"] = means[0], means[1]
            metrics[f"{key}/in_vocab"], metrics[f"{key}/ce"] = means[2], means[3]
            if kept is not None:  # align_topk: the CE of the rows that count
                metrics[f"{key}/ce"] = (part[:, 3] * kept).sum().item() / max(1, int(kept.sum()))
    metrics["loss"] = total.item()
    return total, metrics
