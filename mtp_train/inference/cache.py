"""A KV cache for a batch of sequences that grow by different amounts, croppable row by row.

Speculative decoding makes every row of a batch accept a different number of drafted tokens, so after
each verification the rows' caches must be cut back to different lengths. `SlotCache` keeps, per layer,
keys and values `[B, heads, S, d]` in preallocated buffers (grown geometrically, so appending a step's
entries writes only those entries instead of copying the whole cache) plus one validity mask
`valid [B, S]` shared by all layers. Each forward appends its tokens at the same new slots for every row;
the attention mask built from `valid` hides every slot that is not a real entry of that row.

Rolling a row back marks its rejected slots invalid. Nothing is moved then: slots that are invalid in
every row at the end are given back at once (the write position moves back; at batch 1 that is every
rollback), and the holes that rollbacks leave inside the cache are squeezed out (one gather per layer)
only when squeezing would free more than a quarter of the slots (a compacted cache is as wide as its
longest row; a shorter row keeps padding slots before its entries). A row's real entries are always
exactly those a fresh prefill of its kept tokens would write: no stale entry is ever attended to. Keys are
stored after rotary embedding and positions are passed explicitly, so where an entry sits never changes
what it encodes.

A draft tree is verified in one forward with an explicit tree mask (`attention_mask(..., tree=)`: each
token sees the committed slots and its ancestors); afterwards `keep_new` keeps the slots of the accepted
path only. They were written at the positions a prefill of the path would use, so the same invariant holds.

The cache implements the two methods transformers' attention layers call (`update`, `get_seq_length`), so
the same class serves an HF causal LM (every layer) and the draft head (its single layer).
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64  # slots allocated at first use; doubled whenever they run out
MAX_HOLES = 0.25  # squeeze the holes out when that frees more than this share of the slots


def right_align(valid: torch.Tensor) -> torch.Tensor:
    """valid [B, T] -> index [B, T] that moves each row's valid entries to the end, in order (stable)."""
    return torch.argsort(valid.to(torch.int8), dim=1, stable=True)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, 1, Q, K] (True = may attend) -> 0 / most-negative additive mask, as the head expects."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                      torch.finfo(dtype).min)


class SlotCache:
    """Per-row croppable KV cache over `B` rows. `valid [B, S]` says which slots hold real entries."""

    def __init__(self, batch: int, device: torch.device | str = "cpu"):
        self._keys: list[torch.Tensor] = []  # per layer [B, heads, capacity, d]; slots [0, S) are in use
        self._values: list[torch.Tensor] = []
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # [B, S]
        self._written: list[int] = []  # per layer: slots written, this forward's included

    # -- what transformers' attention calls --------------------------------------------------------------
    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        """Write this forward's entries for one layer at slots [S, S + T); return the layer's slots
        [0, S + T) for attention (views of the buffers)."""
        start, end = self.slots, self.slots + keys.shape[-2]
        if layer_idx == len(self._keys):
            self._keys.append(self._alloc(keys, end))
            self._values.append(self._alloc(values, end))
        elif end > self._keys[layer_idx].shape[-2]:
            self._keys[layer_idx] = self._grow(self._keys[layer_idx], start, end)
            self._values[layer_idx] = self._grow(self._values[layer_idx], start, end)
        self._keys[layer_idx][..., start:end, :] = keys
        self._values[layer_idx][..., start:end, :] = values
        self._written[layer_idx:layer_idx + 1] = [end]
        return self._keys[layer_idx][..., :end, :], self._values[layer_idx][..., :end, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots the layer has written, holes included (what its attention sees)."""
        return self._written[layer_idx] if layer_idx < len(self._written) else 0

    @staticmethod
    def _alloc(like: torch.Tensor, needed: int) -> torch.Tensor:
        B, heads, _, d = like.shape
        return like.new_empty(B, heads, max(MIN_CAPACITY, 2 * needed), d)

    @staticmethod
    def _grow(buffer: torch.Tensor, used: int, needed: int) -> torch.Tensor:
        new = SlotCache._alloc(buffer, needed)
        new[..., :used, :] = buffer[..., :used, :]
        return new

    # -- the entries, as attention sees them ---------------------------------------------------------------
    @property
    def keys(self) -> list[torch.Tensor]:  # per layer [B, heads, S, d]
        return [k[..., :self.slots, :] for k in self._keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[..., :self.slots, :] for v in self._values]

    # -- bookkeeping around a forward ---------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    @property
    def lengths(self) -> torch.Tensor:  # [B] real entries per row
        return self.valid.sum(1)

    def positions(self, new_valid: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Positions [B, T] of T new tokens (right-aligned per row, `new_valid [B, T]`): each row continues
        from its own length. `offset` shifts them (the head's pair for h_i sits at position i + 1)."""
        pos = self.lengths[:, None] + new_valid.long().cumsum(1) - 1 + offset
        return pos.clamp(min=0)

    def attention_mask(self, new_valid: torch.Tensor, dtype: torch.dtype,
                       tree: torch.Tensor | None = None) -> torch.Tensor:
        """Additive mask [B, 1, T, S + T] for T new tokens: every valid cached slot, and the new tokens
        causally. A padding query also sees itself, so no row of the mask is empty (an empty row would
        give NaN from softmax, and the NaN would sit in the cache).

        `tree` (bool [B, T, W], W >= T) replaces the last W columns: the last W - T cached slots (a draft
        tree's earlier entries) and the T new tokens, which then see exactly the entries `tree` marks there
        (their ancestors; each token always sees itself), plus every valid slot before those columns (the
        committed prefix)."""
        B, T = new_valid.shape
        device = new_valid.device
        old = self.valid[:, None, :].expand(B, T, self.slots)
        eye = torch.eye(T, dtype=torch.bool, device=device)[None]
        if tree is None:
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            return additive(torch.cat([old, (causal[None] & new_valid[:, None, :]) | eye], dim=-1)[:, None], dtype)
        W = tree.shape[-1]
        if tree.shape[:2] != (B, T) or not T <= W <= self.slots + T:
            raise ValueError(f"tree mask of shape {tuple(tree.shape)} for {T} new tokens over {self.slots} "
                             f"cached slots: expected [{B}, {T}, W] with {T} <= W <= {self.slots + T}")
        tree = tree.to(device=device, dtype=torch.bool).clone()
        tree[..., W - T:] |= eye
        return additive(torch.cat([old[..., :self.slots + T - W], tree], dim=-1)[:, None], dtype)

    def commit(self, new_valid: torch.Tensor) -> None:
        """Record the validity of the T slots the forward just appended."""
        self.valid = torch.cat([self.valid, new_valid.to(self.valid.device)], dim=1)
        self._tidy()

    def keep_new(self, kept: torch.Tensor) -> None:
        """Keep, of the T slots the last forward appended, those `kept [B, T]` marks, in place (a verified
        draft tree: the pending token and the accepted path). The others become holes; a row's real entries
        stay in order, so the next positions (from `lengths`) continue the kept ones."""
        T = kept.shape[1]
        if kept.shape[0] != self.batch or T > self.slots:
            raise ValueError(f"keep_new: kept of shape {tuple(kept.shape)} for a cache of {self.batch} rows "
                             f"and {self.slots} slots")
        self.valid = torch.cat([self.valid[:, :self.slots - T], self.valid[:, self.slots - T:]
                                & kept.to(self.valid.device)], dim=1)
        self._tidy()

    def keep(self, lengths: torch.Tensor) -> None:
        """Keep the first `lengths[b]` real entries of each row (roll back rejected tokens)."""
        if bool((lengths > self.lengths).any()):
            raise ValueError(f"cannot keep {lengths.tolist()} entries of rows holding {self.lengths.tolist()}")
        self.valid = self.valid & (self.valid.long().cumsum(1) <= lengths[:, None].to(self.valid.device))
        self._tidy()

    def _tidy(self) -> None:
        """Give back the slots at the end that no row uses; squeeze out the holes when they are many."""
        self._sync()
        used = self.valid.any(0)
        if self.slots and not bool(used[-1]):
            last = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
            self.valid = self.valid[:, :last]
            self._sync()
        if self.batch and self.slots - int(self.lengths.max()) > MAX_HOLES * self.slots:
            self.compact()  # S' = the longest row: every column it frees is a hole in every row

    def compact(self) -> None:
        """Move each row's entries to the end of the used slots, drop slots that are padding in every row."""
        if bool(self.valid.all()):
            return
        index = right_align(self.valid)
        drop = self.slots - int(self.lengths.max()) if self.batch else self.slots
        index = index[:, drop:]  # [B, S']
        S = index.shape[1]
        for store in (self._keys, self._values):
            for i, t in enumerate(store):
                moved = t[..., :self.slots, :].gather(
                    -2, index[:, None, :, None].expand(t.shape[0], t.shape[1], S, t.shape[3]))
                t[..., :S, :] = moved
        self.valid = self.valid.gather(1, index)
        self._sync()

    def _sync(self) -> None:
        self._written = [self.slots] * len(self._keys)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch (finished sequences leave), in that order. Rows in increasing order
        (what decoding asks for) move down inside the buffers: no new allocation, only the used slots of
        the rows that move are copied."""
        order = rows.tolist()
        if order == sorted(set(order)):
            S = self.slots
            for store in (self._keys, self._values):
                for i, t in enumerate(store):
                    for j, r in enumerate(order):
                        if r != j:  # r > j: row r is read before anything overwrites it
                            t[j, :, :S] = t[r, :, :S]
                    store[i] = t[:len(order)]
        else:
            for store in (self._keys, self._values):
                for i, t in enumerate(store):
                    store[i] = t.index_select(0, rows.to(t.device))
        self.valid = self.valid.index_select(0, rows.to(self.valid.device))
        self._tidy()
