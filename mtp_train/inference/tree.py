"""Tree drafting (EAGLE-2's dynamic draft tree, with SGLang's three settings) and its verification.

A chain drafts one continuation; a tree drafts several and the target verifies all of them in one forward,
each draft token attending to the committed prefix and to its own ancestors only.

Expansion (`grow`), per row, from the drafter's distribution q after the pending token:

    depth 1       the topk tokens of q; a node's score is log q of it
    depth 2..S    the drafter runs once over the frontier (the topk best nodes of the previous depth, in one
                  batched forward with a tree mask over its own cache); each proposes its topk children,
                  score = the parent's score + log q(child); the next frontier is the topk best of those
                  topk * topk candidates
    selection     the num_draft_tokens - 1 best nodes among all generated (topk + (S-1) * topk^2), by score

A child's score is at most its parent's (log q <= 0) and ties go to the earlier-generated node (a parent is
always generated before its children), so the chosen set is closed under ancestors. It is returned in
generation order (parents first) as `DraftTree`: tokens, parents (-1 = the pending token), depth (1-based).
The tree is deterministic (top-k of q): for sampled decoding q is the processed distribution
(`sampling.probabilities`), used for the scores only.

Verification of [pending, node_1 .. node_{N-1}] (positions = the cached length + depth, `DraftTree.mask`),
walking from the pending token:

* greedy: move to the child that carries the target's argmax while there is one; the tokens of the path,
  then the target's argmax at its end, are exactly what target-only greedy decoding emits.
* sampled: at a node with the target's (processed) distribution r = p there, try its children in score
  order: accept child c with probability r(c) and move there (fresh r = p at c); on rejection set r(c) = 0 and
  renormalise. When every child is rejected, the next token is drawn from r. This is sampling from p without
  replacement, one candidate at a time, so every emitted token follows p exactly.

Both take `max_depth [B]`: a row never accepts a node deeper than its limit (a row close to max_new_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mtp_train.inference.config import TreeConfig
from mtp_train.inference.sampling import sample


@dataclass
class DraftTree:
    """num_draft_tokens - 1 = M draft nodes per row, parents before children."""

    tokens: torch.Tensor  # [B, M] target token ids
    parents: torch.Tensor  # [B, M] index of the parent node, -1 = the pending token
    depth: torch.Tensor  # [B, M] 1-based
    scores: torch.Tensor  # [B, M] cumulative log q

    @property
    def size(self) -> int:
        """N = M + 1: the tokens one verification runs, the pending one first."""
        return self.tokens.shape[1] + 1

    def positions(self) -> torch.Tensor:
        """[B, N] depth of [pending, node_1 .. node_M], the pending token at 0: add the cached length."""
        return torch.cat([torch.zeros_like(self.depth[:, :1]), self.depth], dim=1)

    def mask(self) -> torch.Tensor:
        """bool [B, N, N]: token i (0 = pending, j + 1 = node j) sees token k iff k is i or an ancestor of i."""
        B, N = self.tokens.shape[0], self.size
        rows = torch.arange(B, device=self.tokens.device)
        seen = torch.zeros(B, N, N, dtype=torch.bool, device=self.tokens.device)
        seen[:, 0, 0] = True
        for j in range(N - 1):  # a parent's row is complete before its children's
            seen[:, j + 1] = seen[rows, self.parents[:, j] + 1]
            seen[:, j + 1, j + 1] = True
        return seen

    def children(self) -> torch.Tensor:
        """[B, N, F]: the nodes whose parent is token i (0 = pending, j + 1 = node j), in generation (= score)
        order, padded with -1; F is the largest number of children."""
        B, M = self.parents.shape
        before = torch.ones(M, M, dtype=torch.bool, device=self.parents.device).triu(1)  # [i, j]: i < j
        rank = ((self.parents[:, :, None] == self.parents[:, None, :]) & before).sum(1)  # earlier siblings
        F = int(rank.max()) + 1
        out = torch.full((B, (M + 1) * F), -1, dtype=torch.long, device=self.parents.device)
        out.scatter_(1, (self.parents + 1) * F + rank, torch.arange(M, device=out.device).expand(B, M))
        return out.view(B, M + 1, F)


# extend(tokens [B, F], parent [B, F], tree [B, F, W], depth) -> log q [B, F, V]: the drafter runs over the frontier
# (`parent`: each node's parent among the previous call's F nodes, 0 = the pending token on the first call; `tree`:
# what each sees among the tree's entries in the drafter's cache and the new ones; `depth`: the nodes' depth)
Extend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def select(scores: torch.Tensor, parents: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n best of M generated nodes by score (ties: the earlier generated), scores / parents [B, M] in
    generation order (parents: generation index, -1 = root) -> (chosen [B, n] generation indices ascending,
    their parents [B, n] as indices into the chosen, -1 = root). Raises if the choice is not ancestor-closed."""
    B, M = scores.shape
    scores = scores.nan_to_num(nan=float("-inf"))
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    chosen = best.sort(dim=1).values
    where = torch.full((B, M), -1, dtype=torch.long, device=scores.device)
    where.scatter_(1, chosen, torch.arange(n, device=scores.device).expand(B, n))
    old = parents.gather(1, chosen)
    new = torch.where(old >= 0, where.gather(1, old.clamp(min=0)), old)
    if bool(((old >= 0) & (new < 0)).any()):
        raise RuntimeError("draft tree selection is not closed under ancestors: a child scored above its parent")
    return chosen, new


def grow(first: torch.Tensor, extend: Extend, cfg: TreeConfig) -> DraftTree:
    """EAGLE-2's expansion from log q [B, V] after the pending token (see the module docstring)."""
    B, k = first.shape[0], cfg.topk
    device = first.device
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    score, token = first.clamp(max=0).topk(k, dim=-1)  # [B, k] depth 1, best first
    scores, tokens = [score], [token]
    parents, depths = [torch.full((B, k), -1, device=device)], [torch.ones(B, k, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device).expand(B, k)  # generation indices of the nodes to expand
    fed_parent = torch.zeros(B, k, dtype=torch.long, device=device)
    seen, count = eye, k
    for d in range(2, cfg.steps + 1):
        child_lq, child_tok = extend(token, fed_parent, seen, d - 1).clamp(max=0).topk(k, dim=-1)  # [B, k, k]
        cand = (score[:, :, None] + child_lq).flatten(1)  # [B, k * k], parent-major
        cand_tok = child_tok.flatten(1)
        scores.append(cand)
        tokens.append(cand_tok)
        parents.append(frontier[:, :, None].expand(B, k, k).flatten(1))
        depths.append(torch.full((B, k * k), d, dtype=torch.long, device=device))
        best = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :k]
        score, token, frontier = cand.gather(1, best), cand_tok.gather(1, best), count + best
        fed_parent = best // k  # the parent's place among the k nodes fed at this depth
        seen = torch.cat([seen.gather(1, fed_parent[..., None].expand(B, k, seen.shape[-1])), eye], dim=-1)
        count += k * k
    all_scores, all_parents = torch.cat(scores, 1), torch.cat(parents, 1)
    chosen, parent = select(all_scores, all_parents, cfg.num_draft_tokens - 1)
    return DraftTree(torch.cat(tokens, 1).gather(1, chosen), parent, torch.cat(depths, 1).gather(1, chosen),
                     all_scores.gather(1, chosen))


@dataclass
class TreePath:
    nodes: torch.Tensor  # [B, D] the accepted nodes, root to leaf, padded with -1
    accepted: torch.Tensor  # [B] path length
    next: torch.Tensor  # [B] the target's token after the path

    def kept(self, N: int) -> torch.Tensor:
        """bool [B, N]: the verified tokens that stay, the pending one (column 0) and the path's."""
        B = self.nodes.shape[0]
        kept = torch.zeros(B, N + 1, dtype=torch.bool, device=self.nodes.device)
        kept[:, 0] = True
        kept.scatter_(1, torch.where(self.nodes >= 0, self.nodes + 1, N), True)  # padding -> a spare column
        return kept[:, :N]


def _limits(tree: DraftTree, max_depth: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    B, D = tree.tokens.shape[0], int(tree.depth.max())
    if max_depth is None:
        max_depth = torch.full((B,), D, device=tree.tokens.device)
    return D, max_depth.to(tree.tokens.device)


def verify_tree_greedy(tree: DraftTree, logits: torch.Tensor, max_depth: torch.Tensor | None = None) -> TreePath:
    """logits [B, N, V] of [pending, nodes] -> the path that follows the target's argmax."""
    B = logits.shape[0]
    D, max_depth = _limits(tree, max_depth)
    best = logits.argmax(-1)  # [B, N]
    children, rows = tree.children(), torch.arange(B, device=logits.device)
    cur = torch.zeros(B, dtype=torch.long, device=logits.device)  # column: 0 = pending, j + 1 = node j
    nodes = torch.full((B, D), -1, dtype=torch.long, device=logits.device)
    alive = torch.ones(B, dtype=torch.bool, device=logits.device)
    for d in range(D):
        kids = children[rows, cur]  # [B, F]
        match = (kids >= 0) & (tree.tokens.gather(1, kids.clamp(min=0)) == best[rows, cur][:, None])
        match &= (alive & (d < max_depth))[:, None]
        hit = match.any(1)
        node = kids.gather(1, match.long().argmax(1, keepdim=True)).squeeze(1)
        nodes[:, d] = torch.where(hit, node, -1)
        cur = torch.where(hit, node + 1, cur)
        alive &= hit
    return TreePath(nodes, (nodes >= 0).sum(1), best[rows, cur])


def verify_tree_sampled(tree: DraftTree, probs: torch.Tensor, max_depth: torch.Tensor | None = None,
                        generator: torch.Generator | None = None) -> TreePath:
    """probs [B, N, V]: the target's processed distributions at [pending, nodes] -> a path and the next token,
    each emitted token distributed as p (sequential sampling without replacement over the children)."""
    B = probs.shape[0]
    D, max_depth = _limits(tree, max_depth)
    device = probs.device
    children, rows = tree.children(), torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    nodes = torch.full((B, D), -1, dtype=torch.long, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    r = probs[:, 0].clone()  # [B, V] what is left of p at the current node
    for d in range(D):
        kids = children[rows, cur]
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        dest = cur.clone()
        for f in range(kids.shape[1]):
            c = kids[:, f]
            tried = (c >= 0) & alive & ~moved & (d < max_depth)
            tok = tree.tokens.gather(1, c.clamp(min=0)[:, None])  # [B, 1]
            pc = r.gather(1, tok).squeeze(1)
            rest = r.sum(-1) - pc
            u = torch.rand(B, generator=generator, device=device)
            acc = tried & ((u < pc) | (rest <= 0))  # nothing left besides c (rounding): c it is
            rej = tried & ~acc
            dropped = r.scatter(1, tok, 0.0)
            r = torch.where(rej[:, None], dropped / rest.clamp(min=torch.finfo(r.dtype).tiny)[:, None], r)
            moved |= acc
            dest = torch.where(acc, c + 1, dest)
        nodes[:, d] = torch.where(moved, dest - 1, -1)
        cur = dest
        r = torch.where(moved[:, None], probs[rows, cur], r)
        alive &= moved
    return TreePath(nodes, (nodes >= 0).sum(1), sample(r, generator))
