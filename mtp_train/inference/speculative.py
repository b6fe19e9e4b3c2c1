"""The speculative decoding loop: prefill, propose k, verify in one target forward, accept, roll back.

    prefill   the target runs over the prompts (left-padded into one batch) and picks each row's first
              token; that token is *pending*: emitted, not yet in the target's cache.
    propose   the drafter drafts k tokens per row after the pending one.
    verify    one target forward over [pending, d_1 .. d_k] gives p_1 .. p_{k+1}; greedy or rejection
              sampling keeps a leading run of a drafts and picks one more token (a correction, or the
              bonus when all k were kept), so a forward emits a + 1 tokens, between 1 and k + 1.
    roll back the target's cache keeps [pending, d_1 .. d_a] (its entries for rejected drafts are
              dropped, row by row); the drafter drops what it must (`Drafter.accept`).

Without a drafter (or k = 0) the same loop is plain decoding: one forward per token, the next token picked
from the target's logits exactly as the verification picks its bonus token. That is the baseline the
speed-ups are measured against, and greedy speculative output must equal it token for token.

With `tree` (a `TreeConfig`) a step drafts a tree instead of a chain (`tree.py`): the drafter grows it,
one target forward verifies [pending, node_1 .. node_{N-1}] with the tree mask, the walk from the pending
token keeps a path of a nodes and picks one more token, and the target's cache keeps [pending, path]
(`SlotCache.keep_new`). The stats count depths: accepted[j] = steps whose path reached depth j + 1.

A row stops at a stop token (kept in its output) or at `max_new_tokens`; it never drafts past its limit
(k shrinks to the tokens it has left), so no verified token is thrown away for length. Finished rows
leave the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mtp_train.inference.drafters import Drafter, Features
from mtp_train.inference.runner import CausalLMRunner, left_pad
from mtp_train.inference.sampling import (SamplingConfig, next_token, probabilities, verify_greedy,
                                          verify_sampled)
from mtp_train.inference.tree import TreeConfig, verify_tree_greedy, verify_tree_sampled


@dataclass
class DecodeStats:
    """Counts over every verification step of every row (the prefill's first token is not a step)."""

    k: int
    steps: int = 0  # verification forwards, per row
    drafted: list[int] = field(default_factory=list)  # [k]: steps that drafted position j
    accepted: list[int] = field(default_factory=list)  # [k]: steps whose drafts 1..j were all kept and emitted
    # (a kept draft that is a stop token ends the row and is counted as the step's own "+1" token, so
    # emitted = steps + sum(accepted) always: tau = 1 + sum_j accepted[j] / steps)
    emitted: int = 0  # tokens the verification steps emitted (bonus / corrections included)
    new_tokens: int = 0  # every new token, the prefill's included
    seconds: float = 0.0  # wall time, prefill included
    verified: int = 0  # draft tokens the target verified, over every step of every row (a tree's nodes: the
    # per-forward cost; a chain verifies the drafts it proposed)

    def __post_init__(self) -> None:
        self.drafted = self.drafted or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward (bonus included); 1 for plain decoding."""
        return self.emitted / self.steps if self.steps else float("nan")

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(the j-th draft is kept) over the steps that drafted it: kept means drafts 1..j all kept."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted, self.drafted)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else float("nan")

    def add(self, other: "DecodeStats") -> "DecodeStats":
        if other.k != self.k:
            raise ValueError(f"cannot add stats for k={other.k} to k={self.k}")
        return DecodeStats(self.k, self.steps + other.steps, [a + b for a, b in zip(self.drafted, other.drafted)],
                           [a + b for a, b in zip(self.accepted, other.accepted)], self.emitted + other.emitted,
                           self.new_tokens + other.new_tokens, self.seconds + other.seconds,
                           self.verified + other.verified)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt, a final stop token included
    stopped: list[bool]  # ended on a stop token (else on max_new_tokens)
    stats: DecodeStats


def _cat_features(a: Features | None, b: Features) -> Features:
    if a is None:
        return b
    return Features(torch.cat([a.hidden, b.hidden], dim=1), torch.cat([a.valid, b.valid], dim=1))


class SpeculativeDecoder:
    """A batch of prompts being decoded. The constructor prefills; `step()` is one propose / verify /
    accept / roll-back round for every unfinished row; `done` says when every row has stopped.

    State between steps, per active row r (`active[i]` is the prompt index of batch row i):
    `seqs[r]` the committed tokens with the pending one last; the target cache holds `seqs[r][:-1]`;
    `features` the target's h for the tokens committed since the drafter last ran.
    """

    @torch.inference_mode()
    def __init__(self, target: CausalLMRunner, prompts: list[list[int]], *, drafter: Drafter | None = None,
                 k: int = 4, sampling: SamplingConfig | None = None, max_new_tokens: int = 64, stop_tokens=(),
                 generator: torch.Generator | None = None, tree: TreeConfig | None = None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, and no prompt may be empty")
        if tree is not None:
            if drafter is None:
                raise ValueError("a draft tree needs a drafter: pass drafter=..., or decode without tree")
            k = tree.steps  # the stats count acceptance by depth
        if drafter is not None and k < 1:
            raise ValueError(f"k={k}: a drafter must propose at least one token (k >= 1); decode without one "
                             "(speculative=none) instead")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        self.target, self.drafter, self.generator, self.tree = target, drafter, generator, tree
        self.k = k if drafter is not None else 0
        self.sampling = sampling or SamplingConfig()
        self.max_new_tokens = max_new_tokens
        self.stop = {int(t) for t in stop_tokens}
        self.stats = DecodeStats(self.k)
        self.device = target.device

        self.cache = target.new_cache(len(prompts))
        if drafter is not None:
            drafter.start(len(prompts))
        ids, valid = left_pad(prompts, device=self.device)
        self.layers = drafter.feature_layers if drafter is not None else None  # what the drafter reads
        logits, hidden = target.forward(self.cache, ids, valid, logits_last=1, layers=self.layers)
        first = next_token(logits[:, -1], self.sampling, generator).tolist()
        self.seqs = [list(p) + [t] for p, t in zip(prompts, first)]  # committed; the last one is pending
        self.out = [[t] for t in first]
        self.stopped = [t in self.stop for t in first]
        self.features = Features(hidden, valid) if drafter is not None else None
        self.active = list(range(len(prompts)))
        self._drop_finished()

    @property
    def done(self) -> bool:
        return not self.active

    def _drop_finished(self) -> None:
        """Finished rows leave the batch, and every cache."""
        keep = [i for i, r in enumerate(self.active)
                if not self.stopped[r] and len(self.out[r]) < self.max_new_tokens]
        if len(keep) == len(self.active):
            return
        rows = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.select(rows)
        if self.drafter is not None:
            self.drafter.select(rows)
            self.features = Features(self.features.hidden.index_select(0, rows),
                                     self.features.valid.index_select(0, rows))
        self.active = [self.active[i] for i in keep]

    @torch.inference_mode()
    def step(self) -> None:
        n, device, active = len(self.active), self.device, self.active
        # never draft past a row's limit: a row with r tokens left verifies at most r - 1 drafts
        num_drafts = torch.tensor([min(self.k, self.max_new_tokens - len(self.out[r]) - 1) for r in active],
                                  device=device)
        K = int(num_drafts.max())
        if self.tree is not None and K > 0:
            return self._tree_step(num_drafts, K)
        if K > 0:
            proposal = self.drafter.propose([self.seqs[r] for r in active], self.features, K, self.sampling,
                                            self.generator)
            drafts, draft_probs, self.features = proposal.tokens, proposal.probs, None
        else:
            drafts, draft_probs = torch.zeros(n, 0, dtype=torch.long, device=device), None
        pending = torch.tensor([self.seqs[r][-1] for r in active], device=device)
        before = self.cache.lengths
        logits, hidden = self.target.forward(self.cache, torch.cat([pending[:, None], drafts], dim=1),
                                             torch.ones(n, K + 1, dtype=torch.bool, device=device), layers=self.layers)
        if self.sampling.greedy:
            accepted, nxt = verify_greedy(drafts, logits, num_drafts)
        else:
            if draft_probs is None:
                draft_probs = torch.zeros(n, 0, logits.shape[-1], device=device)
            accepted, nxt = verify_sampled(drafts, draft_probs, probabilities(logits, self.sampling), num_drafts,
                                           self.generator)
        self.cache.keep(before + accepted + 1)  # pending + the kept drafts; rejected entries are gone
        if self.drafter is not None:
            kept = torch.arange(K + 1, device=device)[None, :] <= accepted[:, None]
            self.features = _cat_features(self.features, Features(hidden, kept))  # h of the new committed tokens
            if K > 0:
                self.drafter.accept(accepted)

        self.stats.steps += n
        self.stats.verified += int(num_drafts.sum())
        for j in range(K):
            self.stats.drafted[j] += int((num_drafts > j).sum())
        a_list, d_list = accepted.tolist(), drafts.tolist()
        self._emit([d[:a] for d, a in zip(d_list, a_list)], nxt.tolist())

    def _emit(self, kept: list[list[int]], nxt: list[int]) -> None:
        """Row i emits its kept drafts `kept[i]` and then `nxt[i]`, up to its first stop token; finished rows
        leave."""
        stats = self.stats
        for i, r in enumerate(self.active):
            new = kept[i] + [nxt[i]]
            for m, t in enumerate(new):
                if t in self.stop:  # a kept draft that is a stop token ends the row: it plays the "+1" token
                    new, self.stopped[r] = new[:m + 1], True
                    break
            for j in range(len(new) - 1):  # drafts kept and emitted before the step's last token
                stats.accepted[j] += 1
            self.out[r] += new
            self.seqs[r] += new
            stats.emitted += len(new)
        self._drop_finished()

    def _tree_step(self, max_depth: torch.Tensor, D: int) -> None:
        """Propose a tree per row, verify [pending, nodes] in one target forward with the tree mask, keep the
        pending token and the accepted path in the target's cache (as a prefill of them would have written
        it), and hand their features to the drafter. A row accepts at most max_depth[i] nodes (its limit)."""
        n, device, active = len(self.active), self.device, self.active
        tree = self.drafter.propose_tree([self.seqs[r] for r in active], self.features, self.tree.shallower(D),
                                         self.sampling)
        self.features = None
        pending = torch.tensor([self.seqs[r][-1] for r in active], device=device)
        ids = torch.cat([pending[:, None], tree.tokens], dim=1)  # [n, N]
        positions = self.cache.lengths[:, None] + tree.positions()
        logits, hidden = self.target.forward(self.cache, ids, torch.ones(ids.shape, dtype=torch.bool, device=device),
                                             layers=self.layers, positions=positions, tree=tree.mask())
        if self.sampling.greedy:
            path = verify_tree_greedy(tree, logits, max_depth)
        else:
            path = verify_tree_sampled(tree, probabilities(logits, self.sampling), max_depth, self.generator)
        kept = path.kept(tree.size)  # [n, N] in order: parents come before their children
        self.cache.keep_new(kept)
        self.features = Features(hidden, kept)

        self.stats.steps += n
        self.stats.verified += n * (tree.size - 1)
        usable = tree.depth <= max_depth[:, None]  # [n, M] nodes the row may accept
        for j in range(D):
            self.stats.drafted[j] += int(((tree.depth == j + 1) & usable).any(1).sum())
        nodes, tokens = path.nodes.tolist(), tree.tokens.tolist()
        self._emit([[tokens[i][j] for j in row if j >= 0] for i, row in enumerate(nodes)], path.next.tolist())

    def result(self) -> Generation:
        self.stats.new_tokens = sum(len(o) for o in self.out)
        return Generation(self.out, self.stopped, self.stats)


def generate(target: CausalLMRunner, prompts: list[list[int]], *, drafter: Drafter | None = None, k: int = 4,
             sampling: SamplingConfig | None = None, max_new_tokens: int = 64, stop_tokens=(),
             generator: torch.Generator | None = None, tree: TreeConfig | None = None) -> Generation:
    """Decode `prompts` (token id lists, batched together) with the target, speculatively when a drafter
    is given: a chain of k drafts, or with `tree` a draft tree per step. `generator` (on the target's device)
    makes sampling reproducible. Timed from the prefill on."""
    t0 = time.perf_counter()
    decoder = SpeculativeDecoder(target, prompts, drafter=drafter, k=k, sampling=sampling,
                                 max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, generator=generator,
                                 tree=tree)
    while not decoder.done:
        decoder.step()
    if decoder.device.type == "cuda":
        torch.cuda.synchronize(decoder.device)
    result = decoder.result()
    result.stats.seconds = time.perf_counter() - t0
    return result
