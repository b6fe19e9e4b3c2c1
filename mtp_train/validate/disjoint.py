"""Dev and test prompts kept apart from the training data and from each other (`mtp_train/data/overlap.py` says
what counts as an overlap): a run whose dev or test prompts overlap the run's prepared training data, or whose
test prompts overlap its dev prompts or its prepared val split, is refused before anything is decoded.

The training side is the prepared data itself: the prompt part of every row of the split (the tokens it is not
trained on: system and user turns, target-written prompts included), decoded, so what is checked is what the head
was trained on, whatever the source. The prompt side is each prompt's user text. The `recipe` set (the val split,
known only as token ids) is not checked against training (prepare already keeps the splits apart by content);
test prompts are checked against it.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from mtp_train.data.overlap import TextIndex, overlaps
from mtp_train.data.prompt_sets import PromptSet

SHOWN = 5  # overlaps named in the error


def split_index(data_dir: Path, split: str, tokenizer, index: TextIndex | None = None) -> TextIndex:
    """The prompt part (the tokens not trained on) of every row of a prepared split, decoded, in a TextIndex (rows
    named `<split> row <i>`); a document row (trained on from its first token) is left out."""
    path = Path(data_dir) / split
    if not (path / "dataset_info.json").is_file():
        raise FileNotFoundError(f"no prepared {split} split at {path}: run mtp-train prepare first (the dev and "
                                "test prompts are checked against the training data)")
    index = index if index is not None else TextIndex()
    ds = datasets.load_from_disk(str(path))
    rows = [[t for t, m in zip(ids, mask) if not m] for ids, mask in zip(ds["input_ids"], ds["loss_mask"])]
    for i, text in enumerate(tokenizer.batch_decode(rows, skip_special_tokens=True)):
        if text.strip():
            index.add(text, f"{path} row {i}")
    return index


def _checked(s: PromptSet) -> list[tuple[str, str]]:
    return [(t, f"{s.role} set {w}" if w.startswith(s.name) else f"{s.role} set {s.name}: {w}")
            for t, w in zip(s.texts, s.wheres) if t]


def check_disjoint(data_dir: Path, tokenizer, dev: list[PromptSet], test: list[PromptSet]) -> dict:
    """Raise ValueError naming the overlaps (the first SHOWN) when any dev or test prompt overlaps the training
    split, or a test prompt overlaps the val split, a dev prompt or a prompt of another test set. -> what was
    checked."""
    if not any(_checked(s) for s in dev + test):
        return {"train_rows": None, "dev_prompts": 0, "test_prompts": 0, "overlaps": 0}  # nothing to check
    train = split_index(data_dir, "train", tokenizer)
    found = overlaps([p for s in dev + test for p in _checked(s)], train)
    checked = {"train_rows": len(train), "dev_prompts": sum(len(_checked(s)) for s in dev),
               "test_prompts": sum(len(_checked(s)) for s in test)}
    if test:
        others = split_index(data_dir, "val", tokenizer)
        checked["val_rows"] = len(others)
        for s in dev:
            for text, where in _checked(s):
                others.add(text, where)
        for s in test:  # each test set against the dev side and the test sets before it
            found += overlaps(_checked(s), others)
            for text, where in _checked(s):
                others.add(text, where)
    if found:
        shown = "\n  ".join(str(o) for o in found[:SHOWN])
        more = f"\n  ... and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        raise ValueError(f"{len(found)} held-out prompts overlap the training data or each other (a dev or test "
                         f"figure must come from prompts the head never saw):\n  {shown}{more}\nTake them out of "
                         "the training sources (or the prompt set), prepare again, and train again")
    return {**checked, "overlaps": 0}
