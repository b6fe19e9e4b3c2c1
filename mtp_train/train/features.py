"""Where the trainer's target features come from (`train.features`).

    store   `mtp-train precompute` wrote run_dir/store/{train,val}; the trainer reads it memory-mapped (default)
    online  the frozen target, held by the trainer (every rank its own copy, on its device, in target.dtype),
            computes each micro-batch's features as it is read; nothing is written, so the data is not bounded
            by the disk (each epoch pays the target's forward again)
    hybrid  the first pass is online and writes the store's shards as it goes (the same format, manifest and
            checksums as precompute's: `verify-store` passes, and a later `train.features=store` run reads it);
            later epochs read the shards. With `store.max_bytes` only the shards that fit are written (in the
            data's order) and the samples of the others stay online in every epoch

The trainer makes one call, `open_splits`, for its train and val sources whatever the mode; validation
computes the val split of an online run with `online_split`. Below them each step takes its own part of the
config: the target's (`TargetConfig`), the store's (`StoreConfig`), the head's (the layers it reads) and the run
directory.

Every source gives the trainer the same thing: `fetch(indices)` -> samples as `StoreReader[i]` returns them
(float32 states after the store dtype's rounding), `lengths`, `layers`, `hidden_size` and the plan digest a
store of this data would carry (`manifest["plan_hash"]`, which checkpoints record). The target's forward is
precompute's (`store.forward.sample_states`: the decoder alone, inference mode, length-bucketed batches
padded to `store.pad_multiple`), so on CPU in fp32 an online run reproduces a store-then-train run bit for bit.

Hybrid, in detail: each train shard within the budget is laid out on disk when the run starts (a temporary
file of its final length, `format.ShardFile`); the rows of every sample computed in the first pass are written
into it; every checkpoint flushes the files and records which samples each rank has written
(`.partial/hybrid-rank<r>.json`), so a stopped run resumes with them; at the end of the first pass (or of
training, if that comes first) rank 0 computes the samples no rank wrote (those the epoch's trim left out, or
lost with a kill), finishes each shard (fsync, checksum, rename, record) and writes the manifest when every
shard is written. The val split is small: a hybrid run precomputes it before training.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.compute as pc
import torch

from mtp_train.files import DiskFull, _free_bytes, write_json
from mtp_train.model.config import HeadConfig, TargetConfig
from mtp_train.preempt import STOP_FILE
from mtp_train.store.config import StoreConfig
from mtp_train.store.dtypes import decode, encode
from mtp_train.store.format import (MANIFEST, PARTIAL, ShardFile, build_manifest, bytes_per_token, shard_metadata,
                                    stream_names)
from mtp_train.store.forward import HiddenStates, Ranks, load_decoder, placement, sample_states
from mtp_train.store.precompute import (SPLITS, SplitJob, assemble, existing_state, plan_jobs, prepare_dirs,
                                        remove_leftovers, run_shards)
from mtp_train.store.reader import StoreReader
from mtp_train.train import distributed as dist
from mtp_train.train import subnormals

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

MAX_OPEN = 64  # hybrid: shard files mapped at once


class OnlineSplit:
    """A split whose features the target computes on request (`job`: precompute's plan of the split)."""

    in_process = True  # the target lives in this process: no DataLoader workers

    def __init__(self, job, hidden_states, batch_tokens: int, pad_multiple: int):
        self.job, self.hidden_states = job, hidden_states
        self.batch_tokens, self.pad_multiple = batch_tokens, pad_multiple
        self.dir = job.out_dir
        self.lengths = job.data.lengths
        self.layers = list(job.settings.layers)
        self.hidden_size = job.settings.hidden_size
        self.dtype = job.settings.dtype
        self.manifest = {"plan_hash": job.plan, "layers": self.layers, "dtype": self.dtype}

    def __len__(self) -> int:
        return len(self.lengths)

    def tokens(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples `indices` flattened: input_ids [N], loss_mask [N], offsets [len+1]."""
        table = self.job.data.dataset[list(indices)]  # callers never ask for no samples (fetch returns [] first)
        ids = torch.from_numpy(pc.list_flatten(table["input_ids"]).to_numpy().astype("int64"))
        mask = torch.from_numpy(pc.list_flatten(table["loss_mask"]).to_numpy().astype("int8"))
        lengths = torch.as_tensor(self.lengths[list(indices)], dtype=torch.int64)
        return ids, mask, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])

    def compute(self, indices: list[int]):
        """(input_ids [N], loss_mask [N], offsets, {stream: float32 [N, H] as stored and read back}) on the CPU."""
        ids, mask, offsets = self.tokens(indices)
        n = int(offsets[-1])
        states = {s: torch.empty(n, self.hidden_size) for s in stream_names(self.layers)}
        with subnormals.kept():  # the target's arithmetic as precompute does it: the store's bits
            for rows, xs, _ in sample_states(self.hidden_states, ids, offsets, self.batch_tokens, self.pad_multiple):
                for stream, x in zip(states, xs):
                    states[stream][rows] = decode(*encode(x, self.dtype)).cpu()  # the store's rounding
        return ids, mask, offsets, states

    def fetch(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        if not len(indices):
            return []
        ids, mask, offsets, states = self.compute(indices)
        return samples_of(ids, mask, offsets, states, self.layers)

    def token_chunks(self):
        """(where, input_ids, loss_mask) of each planned shard's samples, from the prepared data."""
        for a, b in self.job.ranges:
            ids, mask, _ = self.job.data.rows(a, b)
            yield f"samples {a}..{b - 1} of {self.job.data.path}", ids, mask

    # the trainer calls these at every source alike; an online split has nothing to keep
    def end_of_pass(self) -> None:
        pass

    def checkpoint(self) -> None:
        pass


def samples_of(ids, mask, offsets, states: dict[str, torch.Tensor], layers) -> list[dict[str, torch.Tensor]]:
    """Flat token rows cut back into `StoreReader`-style samples."""
    out = []
    names = stream_names(layers)
    for j in range(offsets.numel() - 1):
        a, b = int(offsets[j]), int(offsets[j + 1])
        s = {"hidden": states["hidden"][a:b], "input_ids": ids[a:b].long(), "loss_mask": mask[a:b].bool()}
        if layers:
            s["layers"] = torch.stack([states[n][a:b] for n in names[1:]])
        out.append(s)
    return out


class HybridSplit(OnlineSplit):
    """The train split of a hybrid run: online in the first pass, writing the shards within the byte budget;
    from the shards afterwards (module docstring). Every rank builds one; rank 0 alone prepares the directory
    and finishes the shards."""

    def __init__(self, job, hidden_states, batch_tokens: int, pad_multiple: int, *, state: str, max_bytes: float,
                 rank: int, world: int, say=print):
        super().__init__(job, hidden_states, batch_tokens, pad_multiple)
        self.rank, self.world, self.say = rank, world, say
        per_token = bytes_per_token(job.settings.dtype, job.settings.hidden_size, len(job.settings.layers))
        sizes = [job.tokens(k) * per_token for k in range(len(job.ranges))]
        budget, total, self.kept = max_bytes or float("inf"), 0, 0  # shards 0..kept-1 are written
        for size in sizes:
            if total + size > budget:
                break
            total, self.kept = total + size, self.kept + 1
        self.shard_of = torch.zeros(len(self.lengths), dtype=torch.long)
        for k, (a, b) in enumerate(job.ranges):
            self.shard_of[a:b] = k
        self.reader = None  # over the finished shards, once the first pass is over
        self.files: OrderedDict[int, ShardFile] = OrderedDict()  # the open ones (at most MAX_OPEN: each maps a file)
        self.written: dict[int, set[int]] = {}  # this rank's samples written per unfinished shard
        self.first_pass = state != "done" and not all(job.finished(k) for k in range(self.kept))
        if not self.first_pass:
            self._open_reader()
            return
        if rank == 0:  # every shard file laid out (its whole length allocated) before any rank writes into one
            self._check_space(sizes)
            for k in range(self.kept):
                if job.finished(k) is None and not self._file(k).reopened:
                    self._forget(k)  # a file made anew holds none of the rows a record may name
            for f in self.files.values():
                f.close()
            self.files.clear()
        dist.barrier()
        records = self._records()
        for k in range(self.kept):
            if job.finished(k) is None:
                self.written[k] = set(records.get(str(k), ()))
        mine = sum(len(v) for v in self.written.values())
        if mine:
            say(f"train: hybrid: resuming the store's first pass with {mine} sample(s) this rank had written")
        if max_bytes and self.kept < len(job.ranges):
            say(f"train: hybrid: store.max_bytes={max_bytes:.0f} holds {self.kept} of {len(job.ranges)} train shards "
                f"({total / 2**20:,.1f} MiB); the samples of the other {len(job.ranges) - self.kept} stay online")

    def _check_space(self, sizes: list[int]) -> None:
        """The shards still to lay out must fit on the file system, or the run stops before it writes any."""
        todo = [k for k in range(self.kept) if self.job.finished(k) is None
                and not self.job.shard_path(k).with_name(self.job.shard_path(k).name + ".tmp").is_file()]
        needed = sum(sizes[k] for k in todo) + 2**20 * len(todo)  # each shard's header and table: under 1 MiB
        free = _free_bytes(self.dir)
        if free is not None and free < needed:
            raise DiskFull(28, f"train.features=hybrid: the {len(todo)} train shard(s) to write in {self.dir} need "
                               f"about {needed:,} bytes, {free:,} are free there; nothing was written. Set "
                               f"store.max_bytes below what is free (the samples of the shards past it stay "
                               "online), free space, or train with train.features=online")

    def _record_path(self, rank: int) -> Path:
        return self.dir / PARTIAL / f"hybrid-rank{rank}.json"

    def _records(self, rank: int | None = None) -> dict[str, list[int]]:
        try:
            saved = json.loads(self._record_path(self.rank if rank is None else rank).read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return saved["written"] if saved.get("plan_hash") == self.job.plan else {}

    def _forget(self, k: int) -> None:
        """Drop shard k from every rank's record of written samples."""
        for r in range(self.world):
            records = self._records(r)
            if str(k) in records:
                del records[str(k)]
                write_json(self._record_path(r), {"plan_hash": self.job.plan, "written": records})

    def _file(self, k: int) -> ShardFile:
        if k in self.files:
            self.files.move_to_end(k)
            return self.files[k]
        a, b = self.job.ranges[k]
        ids, mask, offsets = self.job.data.rows(a, b)
        s = self.job.settings
        self.files[k] = ShardFile(self.job.shard_path(k), ids, mask, offsets, hidden_size=s.hidden_size,
                                  dtype=s.dtype, layers=s.layers, metadata=shard_metadata(self.job.plan, k, a),
                                  reopen=True)
        while len(self.files) > MAX_OPEN:
            self.files.popitem(last=False)[1].close()
        return self.files[k]

    def _write(self, indices: list[int], ids, offsets, states) -> None:
        """Put computed samples' rows into their shard files (samples of shards within the budget only)."""
        for j, i in enumerate(indices):
            k = int(self.shard_of[i])
            if k not in self.written:
                continue
            a = self.job.ranges[k][0]
            first = int(self.job.data.lengths[a:i].sum())  # the sample's first row in its shard
            n = int(offsets[j + 1] - offsets[j])
            rows = torch.arange(first, first + n)
            f = self._file(k)
            for stream, x in states.items():
                f.put(stream, rows, x[int(offsets[j]):int(offsets[j + 1])])
            self.written[k].add(int(i))

    def fetch(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        if not len(indices):
            return []
        if self.reader is not None:  # after the first pass: stored samples from the shards, the rest online
            stored = [i for i in indices if int(self.shard_of[i]) < self.kept]
            online = [i for i in indices if int(self.shard_of[i]) >= self.kept]
            got = dict(zip(stored, self.reader.fetch(stored)))
            got.update(zip(online, OnlineSplit.fetch(self, online)))
            return [got[i] for i in indices]
        ids, mask, offsets, states = self.compute(indices)
        self._write(indices, ids, offsets, states)
        return samples_of(ids, mask, offsets, states, self.layers)

    def checkpoint(self) -> None:
        """Called at every checkpoint: what this rank wrote is on disk and recorded, so a resume keeps it."""
        if not self.first_pass:
            return
        for f in self.files.values():
            f.flush()
        write_json(self._record_path(self.rank), {"plan_hash": self.job.plan,
                                                  "written": {str(k): sorted(v) for k, v in self.written.items()}})

    def end_of_pass(self) -> None:
        """The first pass is over (every rank calls it at the same step): rank 0 computes what no rank wrote,
        finishes the shards and, when all are written, the manifest; then every rank reads them."""
        if not self.first_pass:
            return
        self.checkpoint()
        for f in self.files.values():
            f.close()
        self.files.clear()
        dist.barrier()  # every rank's rows are flushed and recorded
        if self.rank == 0:
            written = {k: set(v) for k, v in self.written.items()}
            for r in range(1, self.world):
                for k, v in self._records(r).items():
                    written.setdefault(int(k), set()).update(v)
            done = 0
            for k in sorted(self.written):
                a, b = self.job.ranges[k]
                missing = [i for i in range(a, b) if i not in written[k]]
                for s in range(0, len(missing), 64):
                    part = missing[s:s + 64]
                    ids, _, offsets, states = self.compute(part)
                    self._write(part, ids, offsets, states)
                info = self._file(k).finish()
                del self.files[k]
                write_json(self.job.record_path(k), {**asdict(info), "plan_hash": self.job.plan})
                done += 1
            if self.kept == len(self.job.ranges):
                assemble(self.job, {"written_by": "train.features=hybrid", "world_size": self.world})
            for r in range(self.world):
                self._record_path(r).unlink(missing_ok=True)
            self.say(f"train: hybrid: the first pass is over; {done} train shard(s) finished in {self.dir}"
                     + ("" if self.kept == len(self.job.ranges) else
                        f" ({self.kept} of {len(self.job.ranges)} within store.max_bytes; no manifest: the store "
                        "is not complete, `mtp-train precompute` would add the rest)"))
            if self.kept == len(self.job.ranges):
                remove_leftovers(self.dir)
        dist.barrier()
        self.files, self.written, self.first_pass = {}, {}, False
        self._open_reader()

    def _open_reader(self) -> None:
        """A reader over the finished shards 0..kept-1 (all of them: the store's own manifest)."""
        if (self.dir / MANIFEST).is_file():
            self.reader = StoreReader(self.dir)
            return
        shards = [self.job.finished(k) for k in range(self.kept)]
        manifest = build_manifest(split=self.job.name, identity=self.job.identity, settings=self.job.settings,
                                  plan=self.job.plan, shards=shards)
        self.reader = StoreReader(self.dir, manifest=manifest)


def open_splits(cfg: "RunConfig", device: torch.device, rank: int, world: int, say=print):
    """The trainer's one call: the train and val feature sources of `cfg.train.features` (module docstring)."""
    mode, run_dir = cfg.train.features, Path(cfg.run_dir)
    if mode == "store":
        return stored_splits(run_dir, cfg.target)
    if not (run_dir / "data" / "manifest.json").is_file():
        raise FileNotFoundError(f"train.features={mode} reads the prepared data in {run_dir / 'data'}, which is not "
                                f"there: run `mtp-train prepare` with the same recipe and run_dir={run_dir} first")
    jobs = plan_jobs(run_dir, cfg.target, cfg.store, cfg.head)  # the tokenizer check, the layers the head reads
    states = [existing_state(job, cfg.store.overwrite) for job in jobs] if mode == "hybrid" else None
    dist.barrier()  # every rank has read the directories before rank 0 changes them
    hidden_states = HiddenStates(load_target(cfg.target, cfg.store, device, world, mode),
                                 list(jobs[0].settings.layers))
    if mode == "online":
        return tuple(OnlineSplit(job, hidden_states, cfg.store.batch_tokens, cfg.store.pad_multiple) for job in jobs)
    return hybrid_splits(jobs, states, hidden_states, cfg.store, run_dir, rank, world, say)


def stored_splits(run_dir: Path, target: TargetConfig) -> tuple[StoreReader, StoreReader]:
    """train.features=store: readers of the run's store, refused when it was made from another target,
    tokenizer or prepared data."""
    store = run_dir / "store"
    for split in SPLITS:
        if not (store / split / MANIFEST).is_file():
            raise FileNotFoundError(f"no hidden-state store at {store / split}: run `mtp-train precompute` "
                                    f"with the same recipe and run_dir={run_dir} first, or train with "
                                    "train.features=online (or hybrid)")
    readers = StoreReader(store / "train"), StoreReader(store / "val")
    data_manifest = run_dir / "data" / "manifest.json"
    for reader in readers:  # another target, tokenizer or dataset: refused
        reader.check_identity(target_path=target.path, tokenizer_path=target.path,
                              data_manifest=data_manifest if data_manifest.is_file() else None)
    return readers


def hybrid_splits(jobs: list[SplitJob], states: list[str], hidden_states: HiddenStates, store: StoreConfig,
                  run_dir: Path, rank: int, world: int, say=print) -> tuple[HybridSplit, StoreReader]:
    """train.features=hybrid: rank 0 prepares both splits' directories (`states`: `existing_state` of each) and
    precomputes the val split (it is small); then every rank opens the train split, which writes its shards in the
    first pass."""
    train_job, val_job = jobs
    if rank == 0:
        prepare_dirs(jobs, states)
        if states[1] != "done":
            run_shards(val_job, hidden_states, Ranks(), store.batch_tokens, run_dir / STOP_FILE, store.pad_multiple)
            assemble(val_job, {"written_by": "train.features=hybrid", "world_size": 1})
    dist.barrier()
    train = HybridSplit(train_job, hidden_states, store.batch_tokens, store.pad_multiple, state=states[0],
                        max_bytes=store.max_bytes, rank=rank, world=world, say=say)
    return train, StoreReader(val_job.out_dir)


def online_split(run_dir: Path, target: TargetConfig, store: StoreConfig, head: HeadConfig, name: str,
                 device: torch.device) -> OnlineSplit:
    """Split `name` (train | val) of the prepared data in `run_dir/data` with its states computed online by the
    target (validate's teacher-forced metrics of a run trained with train.features=online); `head` names the
    layers it reads."""
    job = next(j for j in plan_jobs(Path(run_dir), target, store, head) if j.name == name)
    hidden_states = HiddenStates(load_target(target, store, device, 1, "online"), list(job.settings.layers))
    return OnlineSplit(job, hidden_states, store.batch_tokens, store.pad_multiple)


def load_target(target: TargetConfig, store: StoreConfig, device: torch.device, world: int,
                features: str) -> torch.nn.Module:
    """The frozen target's decoder for online features (`features`: train.features, for the error message): on
    the trainer's device, or with `store.gpus_per_process` > 1 spread over that many GPUs (one process only)."""
    if store.gpus_per_process > 1:
        if world > 1:
            raise ValueError(f"train.features={features} with store.gpus_per_process="
                             f"{store.gpus_per_process} runs one process only (its target spread over its GPUs); "
                             "under torchrun every rank holds a whole target: set store.gpus_per_process=1, or "
                             "precompute the store and train with train.features=store")
        device_map, max_memory = placement(target, store, Ranks())
        return load_decoder(target, device_map, max_memory)
    return load_decoder(target, str(device), None)
