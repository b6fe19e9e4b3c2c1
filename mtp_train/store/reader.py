"""`StoreReader`: samples of a store split by index, read from memory-mapped shards.

Only a sample's own rows are copied out of the map (a few pages of a 1 GB shard), so a store larger than
RAM streams from disk and the page cache decides what stays resident. The reader pickles without its maps
(each DataLoader worker maps the shards again on first use).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from mtp_train.store.dtypes import SAFETENSORS_DTYPES
from mtp_train.store.format import (TensorEntry, read_header, read_manifest, scale_name, shard_layout_problems,
                                    stream_names)
from mtp_train.store.identity import (StoreMismatch, data_identity, identity_mismatches, target_identity,
                                      tokenizer_identity)

__all__ = ["StoreReader", "StoreMismatch"]


class StoreReader:
    """One split of a store (`run_dir/store/train`), as a map-style dataset.

    `reader[i]` is sample i of the prepared split (the store keeps the data's order):
        hidden     FloatTensor [T, H]    float32, dequantized; the target's final hidden state after its norm
        input_ids  LongTensor  [T]
        loss_mask  BoolTensor  [T]
        layers     FloatTensor [L, T, H] only when the store holds extra layers: in the order of
                                         `reader.layers` (layer indices), the residual entering each layer
    """

    def __init__(self, split_dir: str | Path, max_open_shards: int = 64, manifest: dict | None = None):
        """`manifest`: read these shards instead of the split's manifest (a hybrid run's finished first shards
        of a store that is not complete)."""
        self.dir = Path(split_dir)
        self.manifest: dict = read_manifest(self.dir) if manifest is None else manifest
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.layers: list[int] = list(self.manifest["layers"])
        self.dtype: str = self.manifest["dtype"]
        self.max_open_shards = max_open_shards
        self._paths: list[Path] = []
        self._entries: list[dict[str, TensorEntry]] = []
        offsets: list[np.ndarray] = []
        for shard in self.manifest["shards"]:
            path = self.dir / shard["file"]
            if not path.is_file():
                raise FileNotFoundError(f"store {self.dir}: shard {shard['file']} is listed in the manifest but "
                                        "missing; rerun `mtp-train precompute` (it redoes missing shards)")
            entries, _ = read_header(path)
            problems = shard_layout_problems(path, entries, self.manifest, shard)
            if problems:
                raise ValueError(f"store {self.dir}: shard {shard['file']}: {problems[0]}; run "
                                 f"`mtp-train verify-store {self.dir}`")
            self._paths.append(path)
            self._entries.append(entries)
            offsets.append(_read_whole(path, entries["offsets"]))
        self._offsets: list[np.ndarray] = offsets  # per shard [S_k + 1]
        counts = [len(o) - 1 for o in self._offsets]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # first sample of each shard
        self.lengths: np.ndarray = (np.concatenate([np.diff(o) for o in self._offsets]) if offsets
                                    else np.zeros(0, dtype=np.int64))  # tokens per sample, in sample order
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()

    in_process = False  # reads files only: DataLoader workers may read it

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": OrderedDict()}  # maps do not pickle: each process opens its own

    def _map(self, k: int) -> np.memmap:
        if k in self._maps:
            self._maps.move_to_end(k)
        else:
            self._maps[k] = np.memmap(self._paths[k], dtype=np.uint8, mode="r")
            while len(self._maps) > self.max_open_shards:  # bounded: each map holds a file descriptor
                self._maps.popitem(last=False)
        return self._maps[k]

    def _rows(self, k: int, e: TensorEntry, a: int, b: int) -> torch.Tensor:
        """Rows a:b of tensor `e` of shard k, copied out of the map (only these bytes): [b-a, *row shape]."""
        lo, hi = _row_span(e, a, b)
        return _as_tensor(np.array(self._map(k)[lo:hi]), e, b - a)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for store {self.dir} with {n} samples")
        i %= n
        k = int(np.searchsorted(self._first, i, side="right")) - 1
        j = i - int(self._first[k])
        a, b = int(self._offsets[k][j]), int(self._offsets[k][j + 1])
        entries = self._entries[k]

        def stream(name: str) -> torch.Tensor:  # [T, H] float32
            data = self._rows(k, entries[name], a, b).float()
            if self.dtype == "float8_e4m3":
                data *= self._rows(k, entries[scale_name(name)], a, b)[:, None]
            return data

        out = {"hidden": stream("hidden"), "input_ids": self._rows(k, entries["input_ids"], a, b).long(),
               "loss_mask": self._rows(k, entries["loss_mask"], a, b).bool()}
        if self.layers:
            out["layers"] = torch.stack([stream(s) for s in stream_names(self.layers)[1:]])
        return out

    def fetch(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """Samples `indices` (what the trainer's collate asks every feature source for)."""
        return [self[i] for i in indices]

    def token_chunks(self):
        """(where, input_ids [N], loss_mask [N]) of each shard, read without the hidden states."""
        for shard in self.manifest["shards"]:
            with safe_open(str(self.dir / shard["file"]), framework="pt") as f:
                yield f"shard {shard['file']}", f.get_tensor("input_ids"), f.get_tensor("loss_mask")

    # the trainer calls these at every feature source (train/features.py); a finished store writes nothing
    def end_of_pass(self) -> None:
        pass

    def checkpoint(self) -> None:
        pass

    def check_identity(self, target_path: str | Path | None = None, tokenizer_path: str | Path | None = None,
                       data_manifest: str | Path | None = None) -> None:
        """Raise StoreMismatch, naming both sides, if the store was made from another target (config and
        weight index), tokenizer or dataset (`run_dir/data/manifest.json`) than the ones given. Parts left
        as None are not checked."""
        current = {"target": target_identity(target_path) if target_path is not None else None,
                   "tokenizer": tokenizer_identity(tokenizer_path) if tokenizer_path is not None else None,
                   "data": data_identity(data_manifest) if data_manifest is not None else None}
        problems = identity_mismatches(self.manifest, current, self.dir)
        if problems:
            raise StoreMismatch("; ".join(problems))


def _row_span(e: TensorEntry, a: int, b: int) -> tuple[int, int]:
    """The byte range of rows a:b of tensor `e` in its file."""
    row_bytes = SAFETENSORS_DTYPES[e.dtype].itemsize * int(np.prod(e.shape[1:], dtype=np.int64))
    return e.begin + a * row_bytes, e.begin + b * row_bytes


def _as_tensor(raw: np.ndarray, e: TensorEntry, rows: int) -> torch.Tensor:
    """Raw little-endian bytes (a writable uint8 array) as `rows` rows of tensor `e`, without a copy."""
    return torch.from_numpy(raw).view(SAFETENSORS_DTYPES[e.dtype]).reshape(rows, *e.shape[1:])


def _read_whole(path: Path, e: TensorEntry) -> np.ndarray:
    """A small tensor (a shard's offsets) read with a plain file read, as numpy."""
    with open(path, "rb") as f:
        f.seek(e.begin)
        raw = np.frombuffer(f.read(e.end - e.begin), dtype=np.uint8).copy()
    return _as_tensor(raw, e, e.shape[0]).numpy()
