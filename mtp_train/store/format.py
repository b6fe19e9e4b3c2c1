"""The store's on-disk layout, shared by every writer (`precompute`, `write_split`), the reader and
`verify-store`.

A split directory (`run_dir/store/train`, `run_dir/store/val`) holds

    manifest.json                 written last: a split is complete exactly when its manifest exists
    shard-00000.safetensors       consecutive samples of the split, in the data's order
    shard-00001.safetensors ...

and each shard, for its N tokens and S samples:

    hidden           [N, H]  storage dtype  final hidden state after the final norm (what lm_head consumes)
    scale            [N]     float32        fp8 only: hidden ≈ float(hidden) * scale[:, None]
    layer_<i>        [N, H]  storage dtype  extra layer i: the residual stream entering decoder layer i
                                            (HF `hidden_states[i]`), one tensor per entry of `layers`;
                                            i = L (the number of layers) is the last layer's output
                                            before the final norm
    layer_<i>_scale  [N]     float32        fp8 only
    input_ids        [N]     int32
    loss_mask        [N]     int8
    offsets          [S+1]   int64          sample j is tokens offsets[j]:offsets[j+1]

Which samples go into which shard is a plan computed up front from the token counts (`plan_shards`), so
reruns and data-parallel ranks agree on it without talking to each other. The storage dtypes and their encoding
are `dtypes.py`; the run's identity (target, tokenizer, data) the manifest records and a store is checked
against, `identity.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from mtp_train import __version__
from mtp_train.files import sha256_file, space_for, write_json
from mtp_train.store.dtypes import SAFETENSORS_DTYPES, STORE_DTYPES, check_dtype, encode
from mtp_train.store.dtypes import decode  # noqa: F401  re-exported: train/features.py imports it from here
from mtp_train.store.identity import IDENTITY_KEYS
# re-exported: store/precompute.py and tests (conftest, windows, test_train, ...) import these from here
from mtp_train.store.identity import (StoreMismatch, data_identity, identity_for, identity_mismatches,  # noqa: F401
                                     target_identity, tokenizer_identity)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL = ".partial"  # an unfinished split's plan and per-shard records (precompute); gone once complete


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def stream_names(layers: Sequence[int]) -> list[str]:
    """The hidden-state tensors of a shard: the final hidden state, then one per extra layer."""
    return ["hidden"] + [f"layer_{i}" for i in layers]


def scale_name(stream: str) -> str:
    return "scale" if stream == "hidden" else f"{stream}_scale"


# ------------------------------------------------------------------------------------------------ plan


def bytes_per_token(dtype: str, hidden_size: int, n_layers: int = 0) -> int:
    """Bytes one token takes in a shard: each hidden-state stream (plus its fp8 scale), its id and mask."""
    check_dtype(dtype)
    per_stream = STORE_DTYPES[dtype].itemsize * hidden_size + (4 if dtype == "float8_e4m3" else 0)
    return (1 + n_layers) * per_stream + 4 + 1


def shard_tokens_for(shard_mb: float, dtype: str, hidden_size: int, n_layers: int = 0) -> int:
    """The token budget of one shard of about `shard_mb` MiB."""
    return max(1, int(shard_mb * 2**20) // bytes_per_token(dtype, hidden_size, n_layers))


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sample ranges [start, end), each with at most `shard_tokens` tokens (a longer sample gets
    a shard of its own). It depends only on the lengths and the budget, so every rank and every rerun
    computes the same plan."""
    ranges, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_tokens:
            ranges.append((start, i))
            start, tokens = i, 0
        tokens += n
    if len(lengths) > start:
        ranges.append((start, len(lengths)))
    return ranges


@dataclass(frozen=True)
class StoreSettings:
    """What decides a store's bytes besides its identity (target, tokenizer, data): a rerun that changes
    any of these must not mix its shards with the old ones."""

    dtype: str  # storage dtype, a key of STORE_DTYPES
    hidden_size: int
    layers: tuple[int, ...]  # extra layers stored beside the final hidden state
    shard_tokens: int  # token budget per shard (from the shard size)
    compute_dtype: str | None  # the target's dtype when the states were computed; None if written from memory

    def as_dict(self) -> dict:
        return {**asdict(self), "layers": list(self.layers)}

    @classmethod
    def from_dict(cls, m: dict) -> "StoreSettings":
        return cls(dtype=m["dtype"], hidden_size=int(m["hidden_size"]), layers=tuple(m["layers"]),
                   shard_tokens=int(m["shard_tokens"]), compute_dtype=m.get("compute_dtype"))

    def differences(self, other: "StoreSettings") -> list[tuple[str, object, object]]:
        """(field, this value, other's value) for every field that differs."""
        mine, theirs = self.as_dict(), other.as_dict()
        return [(k, mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]]


def plan_hash(identity: dict, settings: StoreSettings, ranges: Sequence[tuple[int, int]]) -> str:
    """One digest of everything that decides the shards' contents. Paths are left out: a target or dataset
    that moved but kept its bytes still matches."""
    payload = {"format_version": FORMAT_VERSION, "settings": settings.as_dict(), "ranges": [list(r) for r in ranges],
               "identity": {k: (identity.get(k) or {}).get(d) for k, d in IDENTITY_KEYS.items()}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------- I/O


def safetensors_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                       metadata: dict[str, str]) -> tuple[bytes, list[str], dict[str, int]]:
    """The bytes before a safetensors file's data (length + JSON header), the tensors' order and each one's
    offset from the start of the file, for tensors `specs` {name: (dtype, shape)}. Tensors go in order of
    decreasing item size, so every one starts aligned to its own item size."""
    names = sorted(specs, key=lambda k: (-specs[k][0].itemsize, k))
    st_names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    table: dict[str, dict] = {"__metadata__": metadata}
    offset, starts = 0, {}
    for name in names:
        dtype, shape = specs[name]
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        table[name] = {"dtype": st_names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        starts[name] = offset
        offset += size
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    head = struct.pack("<Q", len(header)) + header
    return head, names, {k: len(head) + v for k, v in starts.items()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write `tensors` as a safetensors file, streamed from the tensors' memory (no second in-memory copy
    of a 1 GB shard), hashing as it goes; atomically, like `mtp_train.files.write_atomic`. Returns (bytes, sha256)."""
    head, names, _ = safetensors_layout({k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}, metadata)
    h = hashlib.sha256()
    size = 0
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for chunk in (head, *(memoryview(tensors[k].contiguous().view(torch.uint8).numpy()) for k in names)):
            h.update(chunk)
            f.write(chunk)
            size += memoryview(chunk).nbytes
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return size, h.hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records for one shard."""

    file: str
    samples: int
    tokens: int
    masked_tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie inside a safetensors file."""

    dtype: str  # safetensors name, e.g. BF16
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def read_header(path: str | Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensor table and metadata of a safetensors file, read without touching its data."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 1 << 27):
            raise ValueError(f"{path}: not a safetensors file (bad header length): a damaged shard; "
                             "`mtp-train verify-store` names every bad one")
        try:
            table = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path}: the safetensors header is not valid JSON: a damaged shard; "
                             "`mtp-train verify-store` names every bad one") from None
    start = 8 + n
    metadata = table.pop("__metadata__", None) or {}
    entries = {name: TensorEntry(e["dtype"], tuple(e["shape"]), start + e["data_offsets"][0],
                                 start + e["data_offsets"][1]) for name, e in table.items()}
    return entries, metadata


def shard_layout_problems(path: Path, entries: dict[str, TensorEntry], manifest: dict, shard: dict) -> list[str]:
    """What is wrong with a shard's tensor table (names, dtypes, shapes, file length) given what the manifest
    says it holds; cheap, reads no data."""
    st_names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    tokens, samples = shard["tokens"], shard["samples"]
    want = {"input_ids": ("I32", (tokens,)), "loss_mask": ("I8", (tokens,)), "offsets": ("I64", (samples + 1,))}
    for stream in stream_names(manifest["layers"]):
        want[stream] = (st_names[STORE_DTYPES[manifest["dtype"]]], (tokens, manifest["hidden_size"]))
        if manifest["dtype"] == "float8_e4m3":
            want[scale_name(stream)] = ("F32", (tokens,))
    problems = []
    size, needed = path.stat().st_size, max((e.end for e in entries.values()), default=0)
    if size < needed:
        problems.append(f"truncated: {size:,} bytes, its header needs {needed:,}")
    for name, (dtype, shape) in want.items():
        e = entries.get(name)
        if e is None or e.dtype != dtype or e.shape != shape:
            got = "missing" if e is None else f"{e.dtype} {list(e.shape)}"
            problems.append(f"tensor {name!r} is {got}, the manifest implies {dtype} {list(shape)}")
    extra = sorted(set(entries) - set(want))
    if extra:
        problems.append(f"unexpected tensors {extra}")
    return problems


class ShardBuffer:
    """One shard's tensors in memory: token ids, masks and offsets are known up front; hidden states are
    filled by token rows in any order (a length-bucketed batch covers scattered samples), encoded to the
    storage dtype as they arrive, then the shard is written in one piece."""

    def __init__(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor, *,
                 hidden_size: int, dtype: str, layers: Sequence[int] = ()):
        check_dtype(dtype)
        n = int(offsets[-1])
        if input_ids.shape != (n,) or loss_mask.shape != (n,):
            raise ValueError(f"shard buffer: input_ids {tuple(input_ids.shape)} and loss_mask "
                             f"{tuple(loss_mask.shape)} must both be [{n}] (offsets[-1])")
        self.dtype = dtype
        self.tensors: dict[str, torch.Tensor] = {"input_ids": input_ids.to(torch.int32),
                                                 "loss_mask": loss_mask.to(torch.int8),
                                                 "offsets": offsets.to(torch.int64)}
        self._filled: dict[str, int] = {}
        for stream in stream_names(layers):
            self.tensors[stream] = torch.empty(n, hidden_size, dtype=STORE_DTYPES[dtype])  # [N, H]
            if dtype == "float8_e4m3":
                self.tensors[scale_name(stream)] = torch.empty(n, dtype=torch.float32)  # [N]
            self._filled[stream] = 0

    def put(self, stream: str, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Store hidden states x [n, H] (any float dtype, any device) at token rows [n] of `stream`."""
        data, scale = encode(x, self.dtype)
        dst = self.tensors[stream]
        # byte views: index_copy_ has no float8 kernel, and the bytes are all it needs to move
        dst.view(torch.uint8).index_copy_(0, rows, data.cpu().view(torch.uint8))
        if scale is not None:
            self.tensors[scale_name(stream)].index_copy_(0, rows, scale.cpu())
        self._filled[stream] += len(rows)

    def write(self, path: Path, metadata: dict[str, str]) -> ShardInfo:
        n = self.tensors["input_ids"].shape[0]
        unfilled = {s: c for s, c in self._filled.items() if c != n}
        if unfilled:
            raise RuntimeError(f"{path}: {unfilled} of {n} token rows filled; refusing to write a partial shard")
        needed = sum(t.numel() * t.element_size() for t in self.tensors.values())
        with space_for(path, needed, "shard", "every finished shard is kept (its record names it)",
                       partial=[path.with_name(path.name + ".tmp")]):
            size, digest = write_safetensors(path, self.tensors, metadata)
        return ShardInfo(file=path.name, samples=self.tensors["offsets"].numel() - 1, tokens=n,
                         masked_tokens=int(self.tensors["loss_mask"].sum()), bytes=size, sha256=digest)


class ShardFile:
    """A shard laid out on disk before its hidden states are known (hybrid training computes them in the
    trainer's order, scattered over the split): header, token ids, masks and offsets are written at once,
    the file's whole length allocated (a full disk fails here, not in a write through the map), hidden-state
    rows are written through a memory map as they arrive, and `finish` makes it the shard `ShardBuffer.write`
    writes from the same states, byte for byte. `reopen` keeps a temporary file of the right length that an
    earlier, stopped run left (its recorded rows stay valid)."""

    def __init__(self, path: Path, input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor, *,
                 hidden_size: int, dtype: str, layers: Sequence[int], metadata: dict[str, str], reopen: bool = False):
        check_dtype(dtype)
        self.path, self.tmp, self.dtype = path, path.with_name(path.name + ".tmp"), dtype
        fixed = {"input_ids": input_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.int8),
                 "offsets": offsets.to(torch.int64)}
        n = int(offsets[-1])
        self.tokens, self.samples, self.masked = n, offsets.numel() - 1, int(fixed["loss_mask"].sum())
        specs = {k: (t.dtype, tuple(t.shape)) for k, t in fixed.items()}
        for stream in stream_names(layers):
            specs[stream] = (STORE_DTYPES[dtype], (n, hidden_size))
            if dtype == "float8_e4m3":
                specs[scale_name(stream)] = (torch.float32, (n,))
        head, _, self.starts = safetensors_layout(specs, metadata)
        self.specs = specs
        self.size = max(self.starts[k] + int(torch.Size(sh).numel()) * dt.itemsize for k, (dt, sh) in specs.items())
        self.reopened = reopen and self.tmp.is_file() and self.tmp.stat().st_size == self.size
        if not self.reopened:  # laid out under a third name, so a `.tmp` of the right length is always laid out
            new = path.with_name(path.name + ".tmp.new")
            with space_for(new, self.size, "shard", "every finished shard is kept (its record names it)",
                           partial=[new]):
                with open(new, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, self.size)
                    f.write(head)
                    for k, t in fixed.items():
                        f.seek(self.starts[k])
                        f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(new, self.tmp)
        self._map = np.memmap(self.tmp, dtype=np.uint8, mode="r+")

    def _rows_view(self, name: str):
        dtype, shape = self.specs[name]
        row = dtype.itemsize * (int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1)
        return self._map[self.starts[name]: self.starts[name] + shape[0] * row].reshape(shape[0], row)

    def put(self, stream: str, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Hidden states x [n, H] (any float dtype, any device) at token rows [n] of `stream`."""
        data, scale = encode(x, self.dtype)
        at = rows.cpu().numpy()
        self._rows_view(stream)[at] = data.cpu().contiguous().view(torch.uint8).numpy()
        if scale is not None:
            self._rows_view(scale_name(stream))[at] = scale.cpu().contiguous().view(torch.uint8).numpy()

    def flush(self) -> None:
        self._map.flush()

    def close(self) -> None:
        """Flush and unmap (the file stays; `ShardFile(..., reopen=True)` opens it again)."""
        self._map.flush()
        del self._map

    def finish(self) -> ShardInfo:
        """Flush, fsync, checksum and rename to the shard's name: the finished shard's record."""
        self._map.flush()
        del self._map
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        digest = sha256_file(self.tmp)
        os.replace(self.tmp, self.path)
        return ShardInfo(file=self.path.name, samples=self.samples, tokens=self.tokens, masked_tokens=self.masked,
                         bytes=self.size, sha256=digest)


SHARD_METADATA_KEY = "mtp_train.store"


def shard_metadata(plan: str, index: int, first_sample: int) -> dict[str, str]:
    """What a shard says about itself. One metadata key holding sorted JSON: safetensors writes several
    keys in a per-process random order, which would make identical shards differ byte for byte."""
    return {SHARD_METADATA_KEY: json.dumps({"format_version": FORMAT_VERSION, "plan_hash": plan, "shard": index,
                                            "first_sample": first_sample}, sort_keys=True)}


def shard_plan_hash(metadata: dict[str, str]) -> str | None:
    """The plan digest a shard was written for (None if it carries none)."""
    try:
        return json.loads(metadata[SHARD_METADATA_KEY])["plan_hash"]
    except (KeyError, TypeError, json.JSONDecodeError):
        return None


# -------------------------------------------------------------------------------------------- manifest


def build_manifest(*, split: str, identity: dict, settings: StoreSettings, plan: str, shards: Sequence[ShardInfo],
                   run: dict | None = None) -> dict:
    """The manifest of a complete split. `run` describes how it was computed (informational)."""
    return {
        "format_version": FORMAT_VERSION,
        "created_by": f"mtp_train {__version__}",
        "split": split,
        **{part: identity.get(part) for part in IDENTITY_KEYS},
        "hidden": "final hidden state after the final norm (the input of lm_head)",
        **settings.as_dict(),
        "bytes_per_token": bytes_per_token(settings.dtype, settings.hidden_size, len(settings.layers)),
        "plan_hash": plan,
        "shards": [asdict(s) for s in shards],
        "totals": {"shards": len(shards), "samples": sum(s.samples for s in shards),
                   "tokens": sum(s.tokens for s in shards),
                   "masked_tokens": sum(s.masked_tokens for s in shards), "bytes": sum(s.bytes for s in shards)},
        "run": run,
    }


MANIFEST_KEYS = ("format_version", "dtype", "hidden_size", "layers", "shard_tokens", "plan_hash", "shards", "totals")


def read_manifest(split_dir: str | Path) -> dict:
    """A split's manifest, or an error that says what the directory is instead."""
    d = Path(split_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"store directory not found: {d}")
    path = d / MANIFEST
    if not path.is_file():
        if (d / PARTIAL).is_dir():
            raise ValueError(f"{d} holds an unfinished store (no {MANIFEST} yet): rerun `mtp-train precompute` "
                             "with the same recipe to finish it")
        raise FileNotFoundError(f"{d} has no {MANIFEST}: not a store split directory (expected run_dir/store/train "
                                "or run_dir/store/val, written by `mtp-train precompute`)")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    missing = [k for k in MANIFEST_KEYS if k not in m]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)}: not a store manifest")
    if m["format_version"] > FORMAT_VERSION:
        raise ValueError(f"{path}: store format {m['format_version']} was written by a newer mtp_train "
                         f"({m.get('created_by')}); this is mtp_train {__version__} (format {FORMAT_VERSION})")
    check_dtype(m["dtype"])
    return m


def clear_split(split_dir: Path) -> None:
    """Remove what a store wrote into `split_dir` (manifest, shards, temporary files, the unfinished-run
    records), and nothing else."""
    for p in [split_dir / MANIFEST, *split_dir.glob("shard-*.safetensors"), *split_dir.glob("*.tmp"), *split_dir.glob("*.tmp.new")]:
        p.unlink(missing_ok=True)
    if (split_dir / PARTIAL).is_dir():
        shutil.rmtree(split_dir / PARTIAL)


def holds_store_files(split_dir: Path) -> bool:
    return split_dir.is_dir() and any(p.name == MANIFEST or p.name == PARTIAL or p.name.startswith("shard-")
                                      for p in split_dir.iterdir())


def write_split(split_dir: str | Path, samples: Iterable[dict], *, identity: dict, dtype: str = "float32",
                shard_mb: float = 1024.0, layers: Sequence[int] = (), compute_dtype: str | None = None,
                overwrite: bool = False) -> dict:
    """Write a complete store split from in-memory samples and return its manifest.

    samples: dicts with "hidden" [T, H] (float), "input_ids" [T], "loss_mask" [T], and "layers" [L, T, H]
    when `layers` (L indices) is not empty. `identity`: as made by `identity_for` (parts may be None).
    Writes with the same shard writer and manifest as `precompute`; refuses a directory that already holds
    a store unless `overwrite`."""
    split_dir = Path(split_dir)
    samples = list(samples)
    if not samples:
        raise ValueError("write_split needs at least one sample")
    hidden_size = samples[0]["hidden"].shape[-1]
    for j, s in enumerate(samples):
        t = s["input_ids"].shape[0]
        if s["hidden"].shape != (t, hidden_size) or s["loss_mask"].shape != (t,):
            raise ValueError(f"sample {j}: hidden {tuple(s['hidden'].shape)}, input_ids {tuple(s['input_ids'].shape)}, "
                             f"loss_mask {tuple(s['loss_mask'].shape)}; expected [T, {hidden_size}], [T], [T]")
        if layers and tuple(s["layers"].shape) != (len(layers), t, hidden_size):
            raise ValueError(f"sample {j}: layers {tuple(s['layers'].shape)}; expected [{len(layers)}, {t}, "
                             f"{hidden_size}] for layers {list(layers)}")
    settings = StoreSettings(dtype, hidden_size, tuple(layers), shard_tokens_for(shard_mb, dtype, hidden_size,
                                                                                 len(layers)), compute_dtype)
    ranges = plan_shards([s["input_ids"].shape[0] for s in samples], settings.shard_tokens)
    plan = plan_hash(identity, settings, ranges)
    if holds_store_files(split_dir):
        if not overwrite:
            raise FileExistsError(f"{split_dir} already holds a store; pass overwrite=True to replace it")
        clear_split(split_dir)
    split_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for k, (a, b) in enumerate(ranges):
        part = samples[a:b]
        lengths = torch.tensor([s["input_ids"].shape[0] for s in part])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        buf = ShardBuffer(torch.cat([s["input_ids"] for s in part]), torch.cat([s["loss_mask"] for s in part]),
                          offsets, hidden_size=hidden_size, dtype=dtype, layers=layers)
        rows = torch.arange(int(offsets[-1]))
        buf.put("hidden", rows, torch.cat([s["hidden"] for s in part]))
        for li, stream in enumerate(stream_names(layers)[1:]):
            buf.put(stream, rows, torch.cat([s["layers"][li] for s in part]))
        shards.append(buf.write(split_dir / shard_name(k), shard_metadata(plan, k, a)))
    manifest = build_manifest(split=split_dir.name, identity=identity, settings=settings, plan=plan, shards=shards)
    write_json(split_dir / MANIFEST, manifest)
    return manifest
