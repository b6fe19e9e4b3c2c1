"""The draft vocabulary (`head.draft_vocab=N`): which N target tokens a head drafts over.

The N most frequent tokens among the trained positions of the train split (tokens whose loss_mask is set),
counted from the hidden-state store that training reads (`run_dir/store/train`: its shards hold every token's
id and mask, read without the hidden states); ties go to the smaller token id. When fewer than N distinct
tokens occur, the rest are the smallest ids that never occur (they count 0, and the same order picks them).
The same store always gives the same ids. The head keeps them (`DraftHead.set_draft_vocab`: `d2t`, `t2d` in
every checkpoint); `run_dir/draft_vocab.json` records them for people, with their coverage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_train.files import write_json

DRAFT_VOCAB_JSON = "draft_vocab.json"


@dataclass(frozen=True)
class DraftVocab:
    ids: torch.Tensor  # [N] target ids, ascending
    counts: torch.Tensor  # [V] trained positions per target token
    source: str  # what was counted

    @property
    def trained_positions(self) -> int:
        return int(self.counts.sum())

    @property
    def coverage(self) -> float:
        """The fraction of trained positions whose token is inside (0 when nothing is trained)."""
        total = self.trained_positions
        return int(self.counts[self.ids].sum()) / total if total else 0.0

    @property
    def unseen(self) -> int:
        """Ids chosen although they never occur (fewer distinct trained tokens than N)."""
        return int((self.counts[self.ids] == 0).sum())

    def summary(self) -> str:
        N, V = len(self.ids), len(self.counts)
        extra = (f"; {self.unseen} of them never occur there (filled with the smallest unused ids)"
                 if self.unseen else "")
        return (f"draft vocabulary of {N:,} of {V:,} tokens, covering {self.coverage:.1%} of the "
                f"{self.trained_positions:,} trained positions of {self.source}{extra}")

    def as_dict(self) -> dict:
        return {"draft_vocab": len(self.ids), "target_vocab": len(self.counts), "coverage": self.coverage,
                "trained_positions": self.trained_positions,
                "distinct_trained_tokens": int((self.counts > 0).sum()), "unseen_ids_filled": self.unseen,
                "source": self.source,
                "rule": "the most frequent target tokens among the trained positions (loss_mask set) of the train "
                        "split, ties to the smaller id; ids that never occur fill up by smallest id",
                "token_ids": self.ids.tolist()}


def trained_token_counts(reader, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each token id occurs at a trained position (loss_mask set) of a store
    split (`StoreReader`; or the prepared data of an online one). Reads only token ids and loss masks."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for where, ids, mask in reader.token_chunks():
        trained = ids.long()[mask.bool()]
        if trained.numel() and (int(trained.min()) < 0 or int(trained.max()) >= vocab_size):
            raise ValueError(f"{reader.dir}: {where} holds token id {int(trained.max())}, outside the target's "
                             f"vocabulary of {vocab_size}: the store was made with another tokenizer")
        counts += torch.bincount(trained, minlength=vocab_size)
    return counts


def most_frequent(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n ids with the largest counts, ties to the smaller id, returned ascending [n]."""
    if not 0 < n <= len(counts):
        raise ValueError(f"draft vocabulary of {n} tokens from a vocabulary of {len(counts)}")
    order = torch.sort(-counts, stable=True).indices  # descending counts; equal counts keep ascending ids
    return order[:n].sort().values


def choose_draft_vocab(reader, n: int, vocab_size: int) -> DraftVocab:
    """The draft vocabulary of `n` tokens from a train store split (`StoreReader`)."""
    counts = trained_token_counts(reader, vocab_size)
    return DraftVocab(most_frequent(counts, n), counts,
                      f"{reader.dir} (input_ids where loss_mask is set, {len(reader):,} samples)")


def write_record(run_dir: str | Path, vocab: DraftVocab) -> Path:
    """run_dir/draft_vocab.json: N, coverage, what was counted and the ids, for people."""
    path = Path(run_dir) / DRAFT_VOCAB_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, vocab.as_dict())
    return path
