"""Drafters: what proposes the k tokens the target verifies. One interface, two schemes.

    drafter.start(batch)                                  empty caches for a batch
    drafter.propose(seqs, features, k, sampling, gen)     -> Proposal: k tokens per row (+ their q)
    drafter.accept(accepted)                              roll the drafter's cache back after verification
    drafter.propose_tree(seqs, features, tree, sampling)  -> DraftTree (tree.py); leaves the cache as the
                                                          next call expects (no accept)
    drafter.select(rows)                                  finished rows leave the batch

`seqs[b]` is row b's committed sequence, prompt + emitted tokens; its last token is pending (emitted but
not yet run through the target). `features` are the target's final hidden states (for an eagle3 head: the
residual entering its aux layers, concatenated; `Drafter.feature_layers` says which) for the tokens the
target has committed to its cache since the previous call, in sequence order: the head's input.

* `HeadDrafter`, the trained MTP/EAGLE head (the write-up's MTP schedule). Its cache holds one entry per
  pair (h_i, x_{i+1}) at position i+1, made from the target's own h. After each verification the head is
  re-run over the newly accepted tokens with the target's h for them (this catch-up also yields the first
  draft), then chains: each further draft feeds the head's own ĥ back with the token just drafted. The
  chain's entries are dropped after verification, accepted or not: they were made from ĥ, and the
  catch-up rewrites those positions from the target's h.
* `LMDrafter`, a separate small causal LM with the target's tokenizer (the draft–target scheme): its
  cache holds the committed tokens; it feeds the ones it has not seen, then its own drafts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from mtp_train.inference.cache import SlotCache, right_align
from mtp_train.inference.runner import CausalLMRunner, decode_attention, left_pad
from mtp_train.inference.sampling import SamplingConfig, probabilities, sample
from mtp_train.inference.tree import DraftTree, TreeConfig, grow


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] drafted tokens
    probs: torch.Tensor | None  # [B, k, V] the draft distribution q each was drawn from; None when greedy


@dataclass
class Features:
    """Target hidden states for newly committed tokens: row b's are hidden[b][valid[b]], in order."""

    hidden: torch.Tensor  # [B, T, H]
    valid: torch.Tensor  # [B, T]


class Drafter(ABC):
    """What `SpeculativeDecoder` asks of a drafter; see the module docstring for the protocol."""

    name = "drafter"
    feature_layers: list[int] | None = None  # the target layers whose input the features are; None: final h

    @abstractmethod
    def start(self, batch: int) -> None:
        """Empty caches for a new batch of `batch` rows."""

    @abstractmethod
    def propose(self, seqs: list[list[int]], features: Features, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        """k draft tokens per row after each row's pending token (the last of `seqs[b]`)."""

    def propose_tree(self, seqs: list[list[int]], features: Features, tree: TreeConfig,
                     sampling: SamplingConfig) -> DraftTree:
        """A draft tree per row after each row's pending token (`tree.grow`). The drafter's cache is left as
        the next `propose` / `propose_tree` expects, whatever the target accepts: no `accept` call follows."""
        raise NotImplementedError(f"the {self.name} drafter drafts chains only; decode without a tree")

    @abstractmethod
    def accept(self, accepted: torch.Tensor) -> None:
        """After verification: row b kept its first `accepted[b]` drafts. Roll the cache back to what the
        next `propose` expects."""

    @abstractmethod
    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows, in this order."""


def _draw(logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] -> (token [B], q [B, V] or None when greedy)."""
    if sampling.greedy:
        return logits.argmax(-1), None
    q = probabilities(logits, sampling)
    return sample(q, generator), q


def _log_q(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> log q [..., V], what a draft tree scores its nodes by: the plain softmax when greedy,
    the processed distribution otherwise (-inf where processing removed a token)."""
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return probabilities(logits, sampling).log().clamp(max=0)


def _proposal(tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> Proposal:
    return Proposal(torch.stack(tokens, dim=1), None if probs[0] is None else torch.stack(probs, dim=1))


class HeadDrafter(Drafter):
    """The trained head, drafting from the target's features. `embed` and `lm_head` are the target's own
    modules (the head shares E and W, it never has copies)."""

    name = "head"

    def __init__(self, head: nn.Module, embed: nn.Module, lm_head: nn.Module):
        self.head, self.embed, self.lm_head = head.eval(), embed, lm_head
        self.feature_layers = list(head.aux_layers) or None  # eagle3 reads the residual entering its layers
        self.cache: SlotCache | None = None
        self.committed: torch.Tensor | None = None  # [B] pairs made from target features

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def start(self, batch: int) -> None:
        self.cache = SlotCache(batch, self.device)
        self.committed = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.draft = self.head.draft_lm_head(self.lm_head.weight)  # W's rows for the head's draft vocabulary

    def _draw(self, h: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step's output [B, H] -> (target ids [B], q over the target's vocabulary [B, V], zero outside the
        head's draft vocabulary; None when greedy): drawn over the draft vocabulary, mapped back by the head."""
        d, q = _draw(self.draft.logits(self.head.readout(h)).float(), sampling, generator)
        V = self.lm_head.weight.shape[0]
        return self.draft.to_target(d), None if q is None else self.draft.to_target_probs(q, V)

    def _step(self, tokens: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One head forward over pairs (h [B, T, H], the next tokens [B, T]) right-aligned with valid."""
        with decode_attention(self.device):
            h = self.head(self.embed(tokens), hidden, self.cache.positions(valid, offset=1),
                          self.cache.attention_mask(valid, hidden.dtype), self.cache)
        self.cache.commit(valid)
        return h  # [B, T, H]

    def _catch_up(self, seqs: list[list[int]], features: Features) -> torch.Tensor:
        """The pairs (h_i, x_{i+1}) for the positions the target committed since the last call, from its
        features -> the step's output for the pending token's pair [B, H] (what drafts the first token)."""
        B = len(seqs)
        index = right_align(features.valid)
        valid = features.valid.gather(1, index)
        hidden = features.hidden.gather(1, index[..., None].expand_as(features.hidden))
        counts, done = valid.sum(1).tolist(), self.committed.tolist()
        tokens = torch.zeros(valid.shape, dtype=torch.long)
        for b in range(B):
            if counts[b]:  # x_{i+1} for i = done .. done + count - 1, right-aligned like the features
                nxt = seqs[b][done[b] + 1: done[b] + 1 + counts[b]]
                if len(nxt) != counts[b]:
                    raise RuntimeError(f"row {b}: {counts[b]} new target features but {len(nxt)} tokens after them")
                tokens[b, valid.shape[1] - counts[b]:] = torch.tensor(nxt)
        tokens = tokens.to(self.device)
        h = self._step(tokens, self.head.fuse(hidden.to(self.lm_head.weight.dtype)), valid)[:, -1]  # pending token's
        self.committed = self.cache.lengths.clone()
        return h

    @torch.inference_mode()
    def propose(self, seqs, features, k, sampling, generator=None) -> Proposal:
        B = len(seqs)
        h = self._catch_up(seqs, features)
        drafted, qs = [], []
        for j in range(k):
            d, q = self._draw(h, sampling, generator)
            drafted.append(d)
            qs.append(q)
            if j + 1 < k:  # chain: the head's own ĥ with the token it just drafted
                h = self._step(d[:, None], h[:, None], torch.ones(B, 1, dtype=torch.bool, device=self.device))[:, 0]
        return _proposal(drafted, qs)

    def _log_q(self, out: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """A step's output [..., H] -> log q over the target's vocabulary [..., V], -inf outside the draft
        vocabulary."""
        lq = _log_q(self.draft.logits(self.head.readout(out)).float(), sampling)
        if self.draft.ids is None:
            return lq
        full = lq.new_full((*lq.shape[:-1], self.lm_head.weight.shape[0]), float("-inf"))
        full[..., self.draft.ids] = lq
        return full

    @torch.inference_mode()
    def propose_tree(self, seqs, features, tree, sampling) -> DraftTree:
        """The catch-up, then one head forward per depth over the frontier: node (ĥ of its parent, its token)
        at position committed + depth, seeing the committed pairs and its ancestors' entries."""
        h = self._catch_up(seqs, features)
        base = self.committed[:, None]  # the pending pair sits at position `committed`
        outputs = [h[:, None]]  # [B, F, H] the previous depth's outputs (the pending pair's at first)

        def extend(tokens, parent, seen, depth):
            prev = outputs[-1]
            hidden = prev.gather(1, parent[..., None].expand(*parent.shape, prev.shape[-1]))
            valid = torch.ones(tokens.shape, dtype=torch.bool, device=self.device)
            with decode_attention(self.device):
                out = self.head(self.embed(tokens), hidden, (base + depth).expand(tokens.shape),
                                self.cache.attention_mask(valid, hidden.dtype, tree=seen), self.cache)
            self.cache.commit(valid)
            outputs.append(out)
            return self._log_q(out, sampling)

        drafted = grow(self._log_q(h, sampling), extend, tree)
        self.cache.keep(self.committed)  # drop the tree's entries: the next catch-up uses target features
        return drafted

    def accept(self, accepted: torch.Tensor) -> None:
        self.cache.keep(self.committed)  # drop the chain's entries; the next catch-up uses target features

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.committed = self.committed.index_select(0, rows.to(self.device))


class LMDrafter(Drafter):
    """A small causal LM with the target's tokenizer. Its distributions are cut or padded to the target's
    vocabulary (ids past either model's vocabulary are never drafted)."""

    name = "draft"

    def __init__(self, runner: CausalLMRunner, vocab_size: int):
        self.runner, self.vocab_size = runner, vocab_size
        self.cache: SlotCache | None = None
        self.seen: torch.Tensor | None = None  # [B] committed tokens in the cache

    def start(self, batch: int) -> None:
        self.cache = self.runner.new_cache(batch)
        self.seen = torch.zeros(batch, dtype=torch.long)

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        V, Vd = self.vocab_size, logits.shape[-1]
        if Vd >= V:
            return logits[..., :V]
        return torch.cat([logits, logits.new_full((*logits.shape[:-1], V - Vd), float("-inf"))], dim=-1)

    @torch.inference_mode()
    def propose(self, seqs, features, k, sampling, generator=None) -> Proposal:
        B = len(seqs)
        seen = self.seen.tolist()
        ids, valid = left_pad([s[n:] for s, n in zip(seqs, seen)], device=self.runner.device)
        logits, _ = self.runner.forward(self.cache, ids, valid, logits_last=1)
        self.seen = torch.tensor([len(s) for s in seqs])
        drafted, qs = [], []
        for j in range(k):
            d, q = _draw(self._logits(logits[:, -1]), sampling, generator)
            drafted.append(d)
            qs.append(q)
            if j + 1 < k:
                logits, _ = self.runner.forward(self.cache, d[:, None],
                                                torch.ones(B, 1, dtype=torch.bool, device=self.runner.device))
        return _proposal(drafted, qs)

    @torch.inference_mode()
    def propose_tree(self, seqs, features, tree, sampling) -> DraftTree:
        """Feed the unseen committed tokens, then one forward per depth over the frontier: a node at position
        seen + depth - 1, seeing the committed tokens and its ancestors."""
        seen = self.seen.tolist()
        ids, valid = left_pad([s[n:] for s, n in zip(seqs, seen)], device=self.runner.device)
        logits, _ = self.runner.forward(self.cache, ids, valid, logits_last=1)
        self.seen = torch.tensor([len(s) for s in seqs])
        base = self.cache.lengths[:, None] - 1

        def extend(tokens, parent, mask, depth):
            valid = torch.ones(tokens.shape, dtype=torch.bool, device=self.runner.device)
            out, _ = self.runner.forward(self.cache, tokens, valid, positions=(base + depth).expand(tokens.shape),
                                         tree=mask)
            return _log_q(self._logits(out), sampling)

        drafted = grow(_log_q(self._logits(logits[:, -1]), sampling), extend, tree)
        # drop the tree's entries: the next call feeds the accepted tokens like any committed ones
        self.cache.keep(self.seen.to(self.cache.valid.device))
        return drafted

    def accept(self, accepted: torch.Tensor) -> None:
        """The cache holds the committed tokens, then drafts d_1..d_{k-1}; the first `accepted` drafts are
        now committed too (d_k, if accepted, was never fed: the next call feeds it)."""
        drafts_in_cache = self.cache.lengths - self.seen.to(self.cache.valid.device)
        keep_drafts = torch.minimum(accepted.to(drafts_in_cache.device), drafts_in_cache)
        self.seen = self.seen + keep_drafts.cpu()
        self.cache.keep(self.seen.to(self.cache.valid.device))

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.seen = self.seen.index_select(0, rows.cpu())
