"""Held-out prompts from a run's prepared val split: what validation decodes for `validate.prompts=[recipe]` and
the export's engine check serves in vLLM."""

from __future__ import annotations

from pathlib import Path

import datasets


def held_out_prompts(data_dir: str | Path, n: int, max_tokens: int) -> tuple[list[list[int]], str]:
    """`n` prompts from the prepared val split, spread evenly over it: conversations first, cut where the
    first trained (assistant) token starts, then documents cut at half their length. Returns the prompts
    and a line saying what they are."""
    path = Path(data_dir) / "val"
    if not (path / "dataset_info.json").is_file():
        raise FileNotFoundError(f"no prepared val split at {path}: run mtp-train prepare first (validate decodes "
                                "its held-out prompts)")
    ds = datasets.load_from_disk(str(path))
    chats, docs = [], []
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        first = next((i for i, m in enumerate(mask) if m), len(mask))
        if 0 < first <= max_tokens and first < len(ids):
            chats.append(list(ids[:first]))
        elif first == 0 and len(ids) >= 4:
            docs.append(list(ids[:min(len(ids) // 2, max_tokens)]))

    def spread(pool: list, m: int) -> list:
        return [pool[i * len(pool) // m] for i in range(m)] if m < len(pool) else list(pool)

    conversations = spread(chats, n)
    documents = spread(docs, n - len(conversations))
    return conversations + documents, (f"{path}: {len(conversations)} conversations cut at the assistant turn, "
                                       f"{len(documents)} documents cut at half")
