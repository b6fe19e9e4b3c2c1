"""A KV cache for a batch of sequences that grow by different amounts, croppable row by row.

Speculative decoding makes every row of a batch accept a different number of drafted tokens, so after
each verification the rows' caches must be cut back to different lengths. `SlotCache` keeps, per layer,
keys and values `[B, heads, S, d]` plus one validity mask `valid [B, S]` shared by all layers. Rows are
kept right-aligned ("left padding"): row b's `lengths[b]` entries sit in the last slots, in sequence
order, and the slots before them are padding that the attention mask hides. Rolling a row back is
marking its rejected slots invalid and re-aligning (one gather per layer), so a rolled-back cache holds
exactly the entries a fresh prefill of the kept tokens would write: no stale entry is ever attended to.

The cache implements the two methods transformers' attention layers call (`update`, `get_seq_length`), so
the same class serves an HF causal LM (every layer) and the draft head (its single layer). Keys are stored
after rotary embedding, so moving a slot never changes what it encodes; positions are passed explicitly.
"""

from __future__ import annotations

import torch


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
        self.keys: list[torch.Tensor] = []  # per layer [B, heads, S, d]
        self.values: list[torch.Tensor] = []
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # [B, S]

    # -- what transformers' attention calls --------------------------------------------------------------
    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        """Append this forward's entries for one layer; return the layer's whole cache for attention."""
        if layer_idx == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots in the layer, padding included (what the layer's attention sees)."""
        return self.keys[layer_idx].shape[-2] if layer_idx < len(self.keys) else 0

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

    def attention_mask(self, new_valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, T, S + T] for T new tokens: every valid cached slot, and the new tokens
        causally. A padding query also sees itself, so no row of the mask is empty (an empty row would
        give NaN from softmax, and the NaN would sit in the cache)."""
        B, T = new_valid.shape
        device = new_valid.device
        old = self.valid[:, None, :].expand(B, T, self.slots)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        new = (causal[None] & new_valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=device)[None]
        return additive(torch.cat([old, new], dim=-1)[:, None], dtype)

    def commit(self, new_valid: torch.Tensor) -> None:
        """Record the validity of the T slots the forward just appended; re-align if some were padding."""
        self.valid = torch.cat([self.valid, new_valid.to(self.valid.device)], dim=1)
        if not bool(new_valid.all()):
            self.compact()

    def keep(self, lengths: torch.Tensor) -> None:
        """Keep the first `lengths[b]` real entries of each row (roll back rejected tokens)."""
        if bool((lengths > self.lengths).any()):
            raise ValueError(f"cannot keep {lengths.tolist()} entries of rows holding {self.lengths.tolist()}")
        self.valid = self.valid & (self.valid.long().cumsum(1) <= lengths[:, None].to(self.valid.device))
        self.compact()

    def compact(self) -> None:
        """Move each row's entries to the end, drop slots that are padding in every row."""
        if bool(self.valid.all()):
            return
        index = right_align(self.valid)
        drop = self.slots - int(self.lengths.max()) if self.batch else self.slots
        index = index[:, drop:]  # [B, S']
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = t.gather(-2, index[:, None, :, None].expand(t.shape[0], t.shape[1], index.shape[1],
                                                                        t.shape[3]))
        self.valid = self.valid.gather(1, index)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch (finished sequences leave), in that order."""
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = t.index_select(0, rows.to(t.device))
        self.valid = self.valid.index_select(0, rows.to(self.valid.device))
        self.compact()
