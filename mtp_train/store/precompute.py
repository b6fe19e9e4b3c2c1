"""`mtp-train precompute`: run the target once over `run_dir/data/{train,val}` and store its hidden states
in `run_dir/store/{train,val}` (the layout is in `format.py`). The target's forward, and where it runs, is
`forward.py`'s: the decoder alone, batched by length (sorted within a shard).

Reliability. Which samples go into which shard is planned up front from the token counts. Each shard is
written to a temporary name and renamed, then recorded in `.partial/`; a rerun skips recorded shards and
redoes the others; the manifest is written last. A store made with another target, tokenizer, dataset or
store config is never mixed with nor silently replaced (`store.overwrite=true` replaces it).

Distributed. Under torchrun (WORLD_SIZE > 1) each rank takes the shards k with k % world == rank and
writes them itself; after a barrier rank 0 writes the manifests. With `store.gpus_per_process = g > 1`
each process spreads the target over its own g GPUs (`device_map="auto"`), for targets larger than one GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from mtp_train.files import write_json
from mtp_train.model.config import HeadConfig, TargetConfig
from mtp_train.model.eagle3 import aux_layer_ids
from mtp_train.model.target import TargetArch
from mtp_train.preempt import STOP_FILE, Preempted, StopRequests
from mtp_train.store.config import StoreConfig
from mtp_train.store.format import (MANIFEST, PARTIAL, ShardBuffer, ShardInfo, StoreSettings, build_manifest,
                                    clear_split, holds_store_files, plan_hash, plan_shards, read_manifest,
                                    shard_metadata, shard_name, shard_tokens_for, stream_names)
from mtp_train.store.forward import HiddenStates, Ranks, load_decoder, placement, sample_states
from mtp_train.store.identity import (StoreMismatch, data_identity, identity_mismatches, target_identity,
                                      tokenizer_identity)

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

SPLITS = ("train", "val")
FAIL_AFTER_ENV = "MTP_TRAIN_FAIL_AFTER_SHARDS"  # tests: raise after this many shards, to rehearse a killed run
PAUSE_ENV = "MTP_TRAIN_PAUSE_AFTER_SHARD"  # tests: seconds to sleep after each shard, to signal a run mid-split
BARRIER_TIMEOUT = timedelta(hours=2)  # ranks that finish first wait at a barrier for the slowest


# ----------------------------------------------------------------------------------------------- data


@dataclass
class SplitData:
    """A prepared split (`datasets` on disk), read column-wise through Arrow without loading it."""

    path: Path
    dataset: object  # datasets.Dataset in arrow format
    lengths: np.ndarray  # [S] tokens per sample

    @classmethod
    def open(cls, path: Path, vocab_size: int) -> "SplitData":
        import datasets  # 0.8 s to import: only the runs that read prepared data pay it

        if not path.is_dir():
            raise FileNotFoundError(f"prepared split not found: {path} (run `mtp-train prepare` first)")
        ds = datasets.load_from_disk(str(path)).with_format("arrow")
        missing = {"input_ids", "loss_mask"} - set(ds.column_names)
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; expected the output of `mtp-train prepare`")
        table = ds[:]
        lengths = pc.list_value_length(table["input_ids"]).to_numpy().astype(np.int64)
        bad = np.nonzero(lengths != pc.list_value_length(table["loss_mask"]).to_numpy())[0]
        if len(bad):
            raise ValueError(f"{path}: sample {bad[0]} has {lengths[bad[0]]} input_ids but a loss_mask of another "
                             "length; rerun `mtp-train prepare`")
        top = pc.max(pc.list_flatten(table["input_ids"])).as_py() if len(lengths) else None
        if top is not None and top >= vocab_size:
            raise ValueError(f"{path}: token id {top} >= the target's vocab_size {vocab_size}: the data was "
                             "tokenized for another model; rerun `mtp-train prepare` with this target")
        return cls(path, ds, lengths)

    def rows(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples a:b flattened: input_ids [N] int32, loss_mask [N] int8, offsets [b-a+1] int64."""
        table = self.dataset[a:b]
        ids = pc.list_flatten(table["input_ids"]).to_numpy()
        mask = pc.list_flatten(table["loss_mask"]).to_numpy()
        offsets = np.concatenate([[0], np.cumsum(self.lengths[a:b])])
        return (torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(mask.astype(np.int8)),
                torch.from_numpy(offsets.astype(np.int64)))


def fill_shard(hidden_states: HiddenStates, buf: ShardBuffer, input_ids: torch.Tensor, offsets: torch.Tensor,
               batch_tokens: int, progress: tqdm, multiple: int = 1) -> int:
    """Run the target over one shard's samples and put their states into `buf`; returns the padded tokens."""
    padded = 0
    streams = stream_names(hidden_states.layers)
    for rows, states, batch_padded in sample_states(hidden_states, input_ids, offsets, batch_tokens, multiple):
        for stream, x in zip(streams, states):
            buf.put(stream, rows, x)
        padded += batch_padded
        progress.update(len(rows))
    return padded


# ----------------------------------------------------------------------------------------------- jobs


@dataclass
class SplitJob:
    """One split's store: where, what it must hold, and which shards are finished."""

    name: str
    data: SplitData
    out_dir: Path
    identity: dict
    settings: StoreSettings
    ranges: list[tuple[int, int]]
    plan: str  # plan_hash: the digest every shard and record carries

    @classmethod
    def plan_for(cls, name: str, data: SplitData, out_dir: Path, identity: dict,
                 settings: StoreSettings) -> "SplitJob":
        ranges = plan_shards(data.lengths.tolist(), settings.shard_tokens)
        return cls(name, data, out_dir, identity, settings, ranges, plan_hash(identity, settings, ranges))

    def shard_path(self, k: int) -> Path:
        return self.out_dir / shard_name(k)

    def record_path(self, k: int) -> Path:
        return self.out_dir / PARTIAL / f"shard-{k:05d}.json"

    def finished(self, k: int) -> ShardInfo | None:
        """Shard k's record when the shard was written for this plan and its file is whole, else None."""
        try:
            record = json.loads(self.record_path(k).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        path = self.shard_path(k)
        if record.pop("plan_hash", None) != self.plan or not path.is_file() or path.stat().st_size != record["bytes"]:
            return None
        return ShardInfo(**record)

    def tokens(self, k: int) -> int:
        a, b = self.ranges[k]
        return int(self.data.lengths[a:b].sum())


SETTING_KEYS = {"dtype": "store.dtype", "layers": "store.layers", "shard_tokens": "store.shard_mb",
                "compute_dtype": "target.dtype", "hidden_size": "the target"}


def existing_state(job: SplitJob, overwrite: bool) -> str:
    """What is in the split's directory and what to do about it: fresh (nothing there), done (a complete
    store of this plan), repair (this plan's manifest, but shard files gone or cut short), resume (this
    plan, unfinished) or replace (another plan, with `overwrite`). Any other store raises, naming what
    differs. Reads only: every rank reaches the same answer."""
    d = job.out_dir
    if (d / MANIFEST).is_file():
        recorded, what = read_manifest(d), "a finished store"
    elif (d / PARTIAL / "plan.json").is_file():
        recorded, what = json.loads((d / PARTIAL / "plan.json").read_text()), "an unfinished store"
    elif holds_store_files(d):
        recorded, what = None, "shard files without a manifest"
    else:
        return "fresh"
    if recorded is not None and recorded.get("plan_hash") == job.plan:
        if what == "an unfinished store":
            return "resume"
        whole = all((d / s["file"]).is_file() and (d / s["file"]).stat().st_size == s["bytes"]
                    for s in recorded["shards"])
        return "done" if whole else "repair"
    if overwrite:
        return "replace"
    if recorded is None:
        raise ValueError(f"{d} holds {what}: not a store this run can resume; pass store.overwrite=true to remove "
                         "them, or use another run_dir")
    problems = identity_mismatches(recorded, job.identity, d)
    changed = StoreSettings.from_dict(recorded).differences(job.settings)
    if changed:
        problems.append(f"store {d} settings differ from this run's: " + "; ".join(
            f"{name} {old} -> {new} ({SETTING_KEYS[name]})" for name, old, new in changed))
    if not problems:
        problems.append(f"store {d} was planned differently (format {recorded.get('format_version')})")
    raise StoreMismatch(f"{d} holds {what} made with another config: {'; '.join(problems)}. Nothing was changed: pass "
                        "store.overwrite=true to replace it, or use another run_dir")


def prepare_dir(job: SplitJob, state: str) -> None:
    """Rank 0, between barriers: make the directory match `state` and record the plan."""
    d = job.out_dir
    if state == "replace":
        print(f"precompute: store.overwrite=true: removing the store in {d} made with another config", flush=True)
        clear_split(d)
    (d / PARTIAL).mkdir(parents=True, exist_ok=True)
    if state == "repair":  # keep the shards that are still whole, redo the rest
        manifest = read_manifest(d)
        for k, s in enumerate(manifest["shards"]):
            path = d / s["file"]
            if path.is_file() and path.stat().st_size == s["bytes"]:
                write_json(job.record_path(k), {**s, "plan_hash": job.plan})
        (d / MANIFEST).unlink()
    if state in ("fresh", "replace", "repair"):
        write_json(d / PARTIAL / "plan.json", {"plan_hash": job.plan, **{p: job.identity[p] for p in job.identity},
                                               **job.settings.as_dict(), "shards": len(job.ranges)})


def prepare_dirs(jobs: list[SplitJob], states: list[str]) -> None:
    """Rank 0, between barriers: every split's directory made to match its state (`prepare_dir`); a done one
    only loses what a run stopped right after writing its manifest left behind."""
    for job, state in zip(jobs, states):
        if state == "done":
            remove_leftovers(job.out_dir)
        else:
            prepare_dir(job, state)


def run_shards(job: SplitJob, hidden_states: HiddenStates, ranks: Ranks, batch_tokens: int,
               stop_file: Path | None = None, multiple: int = 1) -> dict:
    """This rank's unfinished shards of `job` (k % world == rank), each computed, written and recorded. Between
    shards a SIGTERM / SIGUSR1 or an existing `stop_file` stops it (Preempted), the finished shards kept."""
    mine = [k for k in range(len(job.ranges)) if k % ranks.world == ranks.rank and job.finished(k) is None]
    fail_after = int(os.environ[FAIL_AFTER_ENV]) if os.environ.get(FAIL_AFTER_ENV) else None
    tokens = sum(job.tokens(k) for k in mine)
    padded = 0
    with tqdm(total=tokens, desc=f"precompute {job.name}", unit="tok", unit_scale=True, dynamic_ncols=True,
              disable=ranks.rank != 0) as progress, StopRequests("precompute", "shard", ranks.rank == 0) as stop:
        for n, k in enumerate(mine, 1):
            if stop.requested or (stop_file is not None and stop_file.exists()):
                raise Preempted(f"precompute: stopped on request ({stop.requested or stop_file}) with {n - 1} of "
                                f"this process's {len(mine)} remaining {job.name} shard(s) written; the same command "
                                "goes on from the next one (finished shards are kept and verified)")
            a, b = job.ranges[k]
            input_ids, loss_mask, offsets = job.data.rows(a, b)
            buf = ShardBuffer(input_ids, loss_mask, offsets, hidden_size=job.settings.hidden_size,
                              dtype=job.settings.dtype, layers=job.settings.layers)
            padded += fill_shard(hidden_states, buf, input_ids, offsets, batch_tokens, progress, multiple)
            info = buf.write(job.shard_path(k), shard_metadata(job.plan, k, a))
            write_json(job.record_path(k), {**asdict(info), "plan_hash": job.plan})
            if os.environ.get(PAUSE_ENV):
                time.sleep(float(os.environ[PAUSE_ENV]))
            if fail_after is not None and n >= fail_after:
                raise RuntimeError(f"{FAIL_AFTER_ENV}={fail_after}: stopping after {n} shard(s) (a test hook that "
                                   "rehearses an interrupted run)")
    return {"shards": len(mine), "tokens": tokens, "padded_tokens": padded}


def assemble(job: SplitJob, run: dict) -> dict:
    """Rank 0, after every rank finished: the manifest from the shard records, written last."""
    shards = []
    for k, (a, b) in enumerate(job.ranges):
        info = job.finished(k)
        if info is None or info.samples != b - a:
            raise RuntimeError(f"{job.out_dir}: shard {shard_name(k)} is missing or incomplete after every rank "
                               "finished; rerun `mtp-train precompute` with the same recipe to redo it")
        shards.append(info)
    manifest = build_manifest(split=job.name, identity=job.identity, settings=job.settings, plan=job.plan,
                              shards=shards, run=run)
    write_json(job.out_dir / MANIFEST, manifest)
    remove_leftovers(job.out_dir)
    return manifest


def remove_leftovers(split_dir: Path) -> None:
    """The unfinished-run records and temporary files of a split whose manifest is written."""
    if (split_dir / PARTIAL).is_dir():
        shutil.rmtree(split_dir / PARTIAL)
    for p in [*split_dir.glob("*.tmp"), *split_dir.glob("*.tmp.new")]:
        p.unlink()


# ------------------------------------------------------------------------------------------------ run


def _barrier(ranks: Ranks) -> None:
    if ranks.world > 1:
        torch.distributed.barrier()


def plan_jobs(run_dir: Path, target: TargetConfig, store: StoreConfig, head: HeadConfig) -> list[SplitJob]:
    """Both splits' plans for the prepared data in `run_dir/data`, from the target's config.json and the store's
    settings (and the layers `head` reads); loads no weights."""
    run_dir = Path(run_dir)
    data_manifest = run_dir / "data" / "manifest.json"
    identity = {"target": target_identity(target.path), "tokenizer": tokenizer_identity(target.path),
                "data": data_identity(data_manifest)}
    made_with = json.loads(data_manifest.read_text()).get("tokenizer") or {}
    if made_with.get("sha256") != identity["tokenizer"]["sha256"]:
        raise StoreMismatch(f"the data in {run_dir / 'data'} was tokenized with {made_with.get('path')} (sha256 "
                            f"{str(made_with.get('sha256'))[:16]}), this run's tokenizer is "
                            f"{identity['tokenizer']['path']} (sha256 {identity['tokenizer']['sha256'][:16]}): "
                            "rerun `mtp-train prepare` with this target")
    arch = TargetArch.from_pretrained(target.path)
    bad = [i for i in store.layers if i > arch.num_hidden_layers]
    if bad:
        raise ValueError(f"store.layers {bad} out of range: the target has {arch.num_hidden_layers} decoder layers "
                         f"(0..{arch.num_hidden_layers - 1}, and {arch.num_hidden_layers} for the final norm's input)")
    layers = stored_layers(store.layers, arch, head)
    dtype = store.storage_dtype(target.dtype)
    settings = StoreSettings(dtype, arch.hidden_size, layers,
                             shard_tokens_for(store.shard_mb, dtype, arch.hidden_size, len(layers)), target.dtype)
    return [SplitJob.plan_for(name, SplitData.open(run_dir / "data" / name, arch.vocab_size),
                              run_dir / "store" / name, identity, settings) for name in SPLITS]


def stored_layers(layers, arch, head: HeadConfig) -> tuple[int, ...]:
    """The layers a store keeps beside the final hidden state: `store.layers`, then those the head reads (an
    eagle3 head's aux layers) that it does not name."""
    return tuple(layers) + tuple(i for i in aux_layer_ids(arch, head) if i not in layers)


def run(cfg: "RunConfig") -> dict[str, dict]:
    """The precompute stage; returns {split: manifest}. Under torchrun every rank calls it. A stop request outside
    `run_shards` (the target loading, the directories being checked) stops it at once (shards on disk are whole)."""
    with StopRequests("precompute", "outside a shard (start-up: planning, loading the target)", at_once=True,
                      then="the same command goes on (finished shards are kept and verified)"):
        return _run(cfg)


def _run(cfg: "RunConfig") -> dict[str, dict]:
    ranks = Ranks.from_env()
    device_map, max_memory = placement(cfg.target, cfg.store, ranks)
    started_dist = ranks.world > 1 and not torch.distributed.is_initialized()
    if started_dist:
        if device_map != "cpu":
            torch.cuda.set_device(torch.device(device_map if device_map != "auto" else f"cuda:{min(max_memory)}"))
        torch.distributed.init_process_group("gloo" if device_map == "cpu" else "nccl", timeout=BARRIER_TIMEOUT)
    say = print if ranks.rank == 0 else (lambda *a, **k: None)
    try:
        jobs = plan_jobs(Path(cfg.run_dir), cfg.target, cfg.store, cfg.head)
        if ranks.rank == 0:  # a stop request of an earlier run was honoured then
            (Path(cfg.run_dir) / STOP_FILE).unlink(missing_ok=True)
        states = [existing_state(job, cfg.store.overwrite) for job in jobs]
        _barrier(ranks)  # every rank has read the directories before rank 0 changes them
        if ranks.rank == 0:
            prepare_dirs(jobs, states)
        _barrier(ranks)
        todo = [job for job, state in zip(jobs, states) if state != "done"]
        for job in jobs:
            if job not in todo:
                say(f"precompute: {job.out_dir} is up to date (same target, tokenizer, data and store config); "
                    "nothing to do")
        pending = {job.name: [k for k in range(len(job.ranges)) if job.finished(k) is None] for job in todo}
        resumed = {job.name: len(job.ranges) - len(pending[job.name]) for job in todo}
        stats = {}
        if any(pending.values()):
            hidden_states = HiddenStates(load_decoder(cfg.target, device_map, max_memory), list(jobs[0].settings.layers))
            if len(jobs[0].ranges) < ranks.world:
                say(f"precompute: {len(jobs[0].ranges)} train shard(s) for {ranks.world} ranks: some ranks idle; "
                    "lower store.shard_mb to spread the work")
            for job in todo:
                t0 = time.perf_counter()
                stats[job.name] = {**run_shards(job, hidden_states, ranks, cfg.store.batch_tokens,
                                                Path(cfg.run_dir) / STOP_FILE, cfg.store.pad_multiple),
                                   "seconds": time.perf_counter() - t0}
        _barrier(ranks)  # every shard is on disk
        if ranks.rank == 0:
            for job in todo:
                s = stats.get(job.name, {"seconds": 0.0})
                computed = sum(job.tokens(k) for k in pending[job.name])
                assemble(job, {"world_size": ranks.world, "device_map": device_map,
                               "attn_implementation": cfg.target.attn_implementation,
                               "batch_tokens": cfg.store.batch_tokens, "shards_computed": len(pending[job.name]),
                               "shards_resumed": resumed[job.name], "tokens_computed": computed,
                               "seconds": round(s["seconds"], 3),  # rank 0's wall time for the split
                               "tokens_per_s": round(computed / s["seconds"], 1) if s["seconds"] > 0 else None,
                               "padding": round(1 - s["tokens"] / s["padded_tokens"], 4) if s.get("padded_tokens")
                               else 0.0})
        _barrier(ranks)  # the manifests exist before any rank reads them
        manifests = {job.name: read_manifest(job.out_dir) for job in jobs}
        say(format_summary(manifests, Path(cfg.run_dir) / "store"))
        return manifests
    finally:
        if started_dist:
            torch.distributed.destroy_process_group()


def format_summary(manifests: dict[str, dict], store_dir: Path) -> str:
    lines = [f"precompute: {store_dir}"]
    for name, m in manifests.items():
        t = m["totals"]
        lines.append(f"  {name:<5} {t['samples']:>8,} samples {t['tokens']:>11,} tokens {t['shards']:>4} shard(s) "
                     f"{t['bytes'] / 2**20:>9,.1f} MiB  {m['dtype']} ({m['bytes_per_token']} B/token)"
                     + (f", layers {m['layers']}" if m["layers"] else ""))
        r = m.get("run") or {}
        if r.get("tokens_computed"):
            lines.append(f"        computed {r['tokens_computed']:,} tokens in {r['seconds']:.1f} s: "
                         f"{r['tokens_per_s']:,.0f} tokens/s with {r['world_size']} process(es), padding "
                         f"{r['padding']:.1%}" + (f", {r['shards_resumed']} shard(s) kept from an earlier run"
                                                   if r["shards_resumed"] else ""))
    return "\n".join(lines)
