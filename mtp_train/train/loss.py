"""The training objective (docs/design.md §4), one module for every head variant.

Per masked position and depth j (weight γ^j):  w_feat · SmoothL1(ĥ, h_next) + w_logit · CE(q, p),
q = softmax(W ĥ), p = softmax(W h_next / T) recomputed from the stored hidden state through the frozen W.
With `accept_weight` w > 0 (the LK loss) the CE becomes (1 - w) · CE(q, p) + w · (-log Σ min(p, q)).
With `topk_weight` w_k > 0 (HASS's top-K distillation, arXiv 2408.15766) a row's term adds
w_k · (-Σ_{x ∈ top-K(p)} p(x) log q(x)): the target's K likeliest tokens weigh (1 + w_k) times.
With `align_topk` k > 0 (GRIFFIN's token-alignable loss mask, arXiv 2502.11018) an anchor's row at depth j has
terms only while the draft's top-k held the target's argmax at every earlier depth: the chains decoding reaches.

The distribution term is `distill.py`'s, chunked so that it never holds [tokens × vocab] for a whole batch.
With a draft vocabulary (`head.draft_vocab`) the target's logits are still formed over the full vocabulary once per
sample, for its argmax and for the expected acceptance (`TargetStats`, kept across epochs), so the metrics mean
what they mean for a full-vocabulary head (see `head_loss`); every depth's rows then go through one
`SharedTargetDistill` pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtp_train.train.config import LossConfig
from mtp_train.train.distill import SharedTargetDistill, distill_ce, draft_holds, target_stats


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
    sub = draft is not None and draft.ids is not None
    keep_outside = sub and cfg.out_of_vocab == "renormalise"  # rows whose target argmax is outside count too
    sels = [predicted_mask(loss_mask, lengths, j) for j in range(len(outputs))]
    # with a draft vocabulary every depth goes in one pass over the target positions (SharedTargetDistill)
    shared = _SharedPass(hidden, loss_mask, lengths, len(outputs), W, cfg, stats, index) if sub and ce is None \
        else None
    reach = torch.ones(loss_mask.shape, dtype=torch.bool, device=loss_mask.device) if cfg.align_topk > 0 else None
    # zero that still depends on the head: a batch with nothing to count backpropagates zeros, not an error
    total = sum(o.sum() for o in outputs).float() * 0.0
    metrics: dict[str, float] = {}
    for j, h_hat in enumerate(outputs):
        rows = _depth_rows(j, h_hat, hidden, sels[j], norm, reach, metrics)
        if rows is None:
            continue
        going_on = reach is not None and j + 1 < len(outputs)  # which anchors' chains go on to the next depth
        if shared is not None:
            shared.add(rows, cfg)
            total = total + cfg.gamma ** j * cfg.w_feat * (rows.feat_sum / rows.denom)
            if going_on:  # depth j + 1's rows must be known before the single pass over every depth
                reach = _reached(rows, draft_holds(rows.x.detach(), draft.weight, draft.ids, shared.targets(rows),
                                                   cfg.align_topk, cfg.chunk_tokens))
            continue
        term, per_row = _depth_distill(rows, W, cfg, ce or distill_ce, draft, keep_outside, metrics)
        total = total + term
        if going_on:
            reach = _reached(rows, _draft_held(rows, per_row, W, cfg, draft))
    if shared is not None and shared.counted:
        total = total + shared.loss(hidden, draft, cfg, keep_outside, len(outputs), metrics)
    metrics["loss"] = total.item()
    return total, metrics


@dataclass
class _DepthRows:
    """Depth j's counted rows of one batch (anchor i at depth j reads the target's h_{i+1+j})."""

    j: int
    key: str  # "d{j+1}", the metrics' prefix
    sel: torch.Tensor  # [B, T] bool: the counted anchors (`predicted_mask`)
    n: int  # their number
    denom: int  # what the depth's terms are divided by (`norm[j]`, or n)
    x: torch.Tensor  # [n, H] the head's ĥ
    y: torch.Tensor  # [n, H] the target's h_{i+1+j}
    kept: torch.Tensor | None  # [n] bool with align_topk: the rows whose chain decoding reaches
    feat_sum: torch.Tensor  # the feature loss summed over the kept rows
    w: int  # anchors whose target position exists (sel is False past them)


def _depth_rows(j: int, h_hat: torch.Tensor, hidden: torch.Tensor, sel: torch.Tensor, norm: list[int] | None,
                reach: torch.Tensor | None, metrics: dict[str, float]) -> _DepthRows | None:
    """Depth j's rows and their feature loss; records d{j+1}/n, /feat (and /reached with `reach`, align_topk's
    [B, T] anchors still reached). None when the depth counts no position."""
    n = int(sel.sum())
    key = f"d{j + 1}"
    metrics[f"{key}/n"] = n
    if n == 0:
        return None
    denom = n if norm is None else norm[j]
    if denom < n:
        raise ValueError(f"head_loss: norm[{j}]={denom} is below this batch's {n} counted positions")
    shift = 1 + j
    target = torch.zeros_like(hidden)
    target[:, :-shift] = hidden[:, shift:]  # h_{i+1+j}
    x, y = h_hat[sel], target[sel]  # [n, H]
    feat_rows = F.smooth_l1_loss(x.float(), y.float(), reduction="none").mean(-1)
    metrics[f"{key}/feat"] = (feat_rows.sum() / n).item()
    kept = reach[sel] if reach is not None else None
    feat_sum = feat_rows.sum() if kept is None else (feat_rows * kept).sum()
    if kept is not None:
        metrics[f"{key}/reached"] = kept.float().mean().item()
    return _DepthRows(j, key, sel, n, denom, x, y, kept, feat_sum, max(0, sel.shape[1] - 1 - j))


def _depth_distill(rows: _DepthRows, W: torch.Tensor, cfg: LossConfig, ce_fn, draft, keep_outside: bool,
                   metrics: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """One depth's distribution term through `ce_fn` (`distill_ce` or the caller's `ce`), and its metrics ce, acc,
    accept (and in_vocab with a draft vocabulary). -> (the depth's weighted terms, feature and distribution;
    per-row metrics)."""
    sub = draft is not None and draft.ids is not None
    extra = (draft.weight, draft.ids) if sub else ()
    own = {"Wt": draft.target_rows} if sub and draft.target_rows is not None else {}  # eagle3: its own lm_head
    lk = {"accept_weight": cfg.accept_weight} if cfg.accept_weight else {}  # a `ce` replacement may not take it
    if keep_outside:
        lk["keep_outside"] = True
    if cfg.topk_weight:
        lk["topk"] = (cfg.topk_weight, cfg.topk)
    j, key, n, denom, x, kept = rows.j, rows.key, rows.n, rows.denom, rows.x, rows.kept
    weight = x.new_full((n,), 1.0 / denom) if kept is None else kept.to(x.dtype) / denom
    ce_sum, per_row = ce_fn(x, rows.y, W, weight, cfg.temperature, cfg.chunk_tokens, *extra, **own, **lk)
    term = cfg.gamma ** j * (cfg.w_feat * (rows.feat_sum / denom) + cfg.w_logit * ce_sum)
    n_kept = n if kept is None else max(1, int(kept.sum()))
    metrics[f"{key}/ce"] = ce_sum.item() if denom == n_kept else ce_sum.item() * denom / n_kept
    metrics[f"{key}/acc"] = per_row[:, 0].mean().item()
    metrics[f"{key}/accept"] = per_row[:, 1].mean().item()
    if sub:
        metrics[f"{key}/in_vocab"] = per_row[:, 2].mean().item()
    return term, per_row


def _draft_held(rows: _DepthRows, per_row: torch.Tensor, W: torch.Tensor, cfg: LossConfig, draft) -> torch.Tensor:
    """[n] bool: whether the draft's top-k (`cfg.align_topk`) held the target's argmax at each of the depth's rows.
    At top-1 the CE's own agreement column (the draft's argmax, as a target id, against the target's
    full-vocabulary argmax) is the test, and no second pass over the vocabulary is made."""
    if cfg.align_topk == 1:
        return per_row[:, 0] > 0.5
    sub = draft is not None and draft.ids is not None
    return draft_holds(rows.x.detach(), draft.weight if sub else W, draft.ids if sub else None,
                       target_stats(rows.y, W, cfg.temperature, cfg.chunk_tokens)[0], cfg.align_topk, cfg.chunk_tokens)


def _reached(rows: _DepthRows, holds: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the anchors whose chain goes on to the next depth (reached here, and their draft held)."""
    reach = torch.zeros_like(rows.sel)
    reach[rows.sel] = holds & rows.kept
    return reach


class _SharedPass:
    """The rows of every depth of a draft-vocabulary loss, gathered for one `SharedTargetDistill` pass: each target
    position's full-vocabulary argmax and logsumexp are computed once (`stats`, a `TargetStats`, built from `W` and
    `cfg` when not given): at depth j anchor i reads h_{i+1+j}, the same h that anchor i+1 reads at depth j-1."""

    def __init__(self, hidden: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, depth: int,
                 W: torch.Tensor, cfg: LossConfig, stats: "TargetStats | None", index: torch.Tensor | None):
        stats = stats or TargetStats(W, cfg.temperature, cfg.chunk_tokens)
        self.top, self.lse = stats(hidden, loss_mask, lengths, depth, index)
        need = needed_positions(loss_mask, lengths, depth)
        self.at = need.nonzero(as_tuple=True)
        self.slot = torch.full(need.shape, -1, dtype=torch.long, device=need.device)  # position -> its row in y
        self.slot[self.at] = torch.arange(self.at[0].shape[0], device=need.device)
        self.rows_x, self.rows_pos, self.rows_w = [], [], []
        self.counted: list[tuple[str, int, torch.Tensor | None]] = []

    def add(self, rows: _DepthRows, cfg: LossConfig) -> None:
        """A depth's rows, with their weights in the loss (γ^j · w_logit / denom; 0 for rows align_topk drops)."""
        j, w, n = rows.j, rows.w, rows.n
        self.rows_x.append(rows.x)
        self.rows_pos.append(self.slot[:, 1 + j:1 + j + w][rows.sel[:, :w]])
        self.rows_w.append(torch.full((n,), cfg.gamma ** j * cfg.w_logit / rows.denom, device=rows.x.device)
                           if rows.kept is None else rows.kept.float() * (cfg.gamma ** j * cfg.w_logit / rows.denom))
        self.counted.append((rows.key, n, rows.kept))

    def targets(self, rows: _DepthRows) -> torch.Tensor:
        """[n] the target's full-vocabulary argmax at each of a depth's rows."""
        j, w = rows.j, rows.w
        return self.top[:, 1 + j:1 + j + w][rows.sel[:, :w]]

    def loss(self, hidden: torch.Tensor, draft, cfg: LossConfig, keep_outside: bool, depth: int,
             metrics: dict[str, float]) -> torch.Tensor:
        """The distribution terms of every depth added so far, in one pass; records each depth's acc, accept,
        in_vocab and ce."""
        # a chunk of c positions is read by up to depth x c rows: chunk_tokens // depth positions keep the peak
        loss, per_row = SharedTargetDistill.apply(
            torch.cat(self.rows_x), torch.cat(self.rows_pos), hidden[self.at], torch.cat(self.rows_w),
            self.top[self.at], self.lse[self.at], draft.weight, draft.ids, draft.target_weight, cfg.temperature,
            max(1, cfg.chunk_tokens // depth), cfg.accept_weight, keep_outside, (cfg.topk_weight, cfg.topk))
        for (key, n, kept), part in zip(self.counted, per_row.split([n for _, n, _ in self.counted])):
            means = part.mean(0).tolist()
            metrics[f"{key}/acc"], metrics[f"{key}/accept"] = means[0], means[1]
            metrics[f"{key}/in_vocab"], metrics[f"{key}/ce"] = means[2], means[3]
            if kept is not None:  # align_topk: the CE of the rows that count
                metrics[f"{key}/ce"] = (part[:, 3] * kept).sum().item() / max(1, int(kept.sum()))
        return loss
