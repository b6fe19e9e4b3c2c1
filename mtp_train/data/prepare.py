"""`mtp-train prepare`: the recipe's sources → `run_dir/data/{train,val}` (token ids + assistant-only loss
masks, `datasets` on disk) and `run_dir/data/manifest.json`.

Order of work, every step deterministic for a given config and input:
with a `target_prompts` source, have the target write its user prompts (synthesize.py) → read each source
(bad records stop the run, or are counted with `on_bad_line=skip`) → deduplicate by content → limit (a
seeded subset) → weight (repeat / subsample) → optionally regenerate assistant turns with the target →
tokenize with the target's chat template → truncate or drop over-long samples → split train/val (by source,
or by a hash of the content) → shuffle (seeded) → write to a temporary directory and rename.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import struct
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
from jinja2 import TemplateError
from tqdm.auto import tqdm

from mtp_train import __version__
from mtp_train.data import synthesize as synth
from mtp_train.data.chat import BadRecord, Tokenized, tokenize_conversation, tokenize_text
from mtp_train.data.decontaminate import RULE_VERSION as DECONTAMINATE_RULE
from mtp_train.data.decontaminate import decontaminate
from mtp_train.data.regenerate import regenerate
from mtp_train.data.sources import Record, Skipped, check_exists, file_digests, read_source
from mtp_train.files import replace_dir, space_for, write_json
from mtp_train.model.target import load_tokenizer, target_fingerprint, tokenizer_hash
from mtp_train.preempt import StopRequests

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

FORMAT_VERSION = 1
# the regeneration engine's settings, left out of the config hash at these defaults and without regeneration (a
# dataset prepared before they existed keeps its hash; what "auto" chose is in the manifest)
REGEN_ADDED = {"regen_engine": "auto", "regen_dtype": "auto", "regen_chunk": 256}


def config_hash(cfg: "RunConfig", sources: list) -> str:
    """What decides the dataset's content: the data config, the seed, the tokenizer, the sources' bytes and,
    when the target rewrites the replies, the target itself."""
    # how it is made, not what: left out; the server settings only when set (a dataset prepared before they
    # existed keeps its hash)
    # the synth_* settings only with a target_prompts source
    how = ("overwrite", "regen_concurrency", "regen_timeout", "regen_retries", "regen_cache")
    synthesized = any(synth.wanted(src) for src in cfg.data.sources)
    data = {k: v for k, v in asdict(cfg.data).items()
            if k not in how and not (k in ("regenerate_server", "regen_model") and not v)
            and not (k.startswith("synth_") and not synthesized)
            and not (k in REGEN_ADDED and (v == REGEN_ADDED[k] or not cfg.data.regenerate))}
    # a source's `turns` only when not the default (a dataset prepared before it existed keeps its hash)
    data["sources"] = [{k: v for k, v in s.items() if not (k == "turns" and v == "all")} for s in data["sources"]]
    if cfg.data.decontaminate:  # what the data is kept apart from
        data["held_out"] = {"rule": DECONTAMINATE_RULE, "dev": list(cfg.validate.prompts),
                            "test": list(cfg.validate.test_prompts)}
    else:
        data.pop("decontaminate", None)  # a dataset prepared before the key existed keeps its hash
    payload = {"data": data, "seed": cfg.seed,
               "tokenizer": tokenizer_hash(cfg.target.path), "sources": sources}
    if cfg.data.regenerate:
        payload["target"] = {"fingerprint": target_fingerprint(cfg.target.path), "dtype": cfg.target.dtype}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _subset(items: list, n: int, seed: str) -> list:
    """A deterministic random subset of `n` items, in their original order."""
    if n >= len(items):
        return items
    chosen = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in chosen]


def _weighted(items: list, weight: float, seed: str) -> list:
    whole, frac = int(math.floor(weight)), weight - math.floor(weight)
    return items * whole + _subset(items, round(frac * len(items)), seed)


def _in_val(record: Record, fraction: float) -> bool:
    return int(record.key()[:8], 16) / 0x100000000 < fraction


def first_turn(record: Record) -> Record:
    """A conversation up to and including its first assistant reply (a text document as it is)."""
    if record.kind != "chat":
        return record
    reply = next((i for i, m in enumerate(record.messages) if m["role"] == "assistant"), len(record.messages))
    return Record("chat", record.where, messages=record.messages[:reply + 1])


def collect(cfg: "RunConfig", written: dict[int, list[Record]] | None = None
            ) -> tuple[list[tuple[int, Record, str]], dict]:
    """Read, check, deduplicate and limit every source: [(source index, record, split)] and per-source
    counts (`written`: the records of the sources read from no file, by index: the target's prompts)."""
    data = cfg.data
    samples: list[tuple[int, Record, str]] = []
    seen: set[str] = set()
    report = []
    for index, src in enumerate(data.sources):
        counts = Counter()
        records = []
        items = written[index] if written and index in written else read_source(src)
        for item in tqdm(items, desc=f"read {src.path}", unit=" records", leave=False):
            if isinstance(item, Skipped):
                counts[f"skipped_{item.kind}"] += 1
                continue
            if isinstance(item, BadRecord):
                if data.on_bad_line == "error":
                    raise ValueError(f"bad input in data.sources[{index}]: {item}; nothing was written. Fix the "
                                     "record, or pass data.on_bad_line=skip to count and skip bad records")
                counts[f"bad_{item.kind}"] += 1
                continue
            counts["records"] += 1
            if src.turns == "first":
                item = first_turn(item)
            if data.dedupe:
                key = item.key()
                if key in seen:
                    counts["duplicates"] += 1
                    continue
                seen.add(key)
            records.append(item)
        if src.limit is not None:
            records = _subset(records, src.limit, f"{cfg.seed}:{index}")
        for r in records:
            split = src.split if src.split != "auto" else ("val" if _in_val(r, data.val_fraction) else "train")
            samples.append((index, r, split))
        counts["kept"] = len(records)
        report.append({"path": src.path, "format": src.format, "split": src.split, "weight": src.weight,
                       "limit": src.limit, "counts": dict(counts)})
    return samples, {"sources": report}


def weigh(cfg: "RunConfig", samples: list[tuple[int, Record, str]], report: dict) -> list[tuple[Record, str]]:
    """Apply each source's weight to its training samples (validation samples are never repeated)."""
    out = []
    for index, src in enumerate(cfg.data.sources):
        train = [(r, s) for i, r, s in samples if i == index and s == "train"]
        weighted = _weighted(train, src.weight, f"{cfg.seed}:{index}:weight")
        report["sources"][index]["counts"]["train_after_weight"] = len(weighted)
        out += weighted + [(r, s) for i, r, s in samples if i == index and s == "val"]
    return out


def tokenize(cfg: "RunConfig", tokenizer, samples: list[tuple[Record, str]]) -> tuple[dict[str, list[Tokenized]], Counter]:
    data = cfg.data
    out: dict[str, list[Tokenized]] = {"train": [], "val": []}
    counts = Counter()
    for record, split in tqdm(samples, desc="tokenize", unit=" samples", leave=False):
        if record.kind == "text":
            chunks = tokenize_text(tokenizer, record.text, data.max_length)
            counts["text_chunks"] += len(chunks)
            out[split].extend(chunks)
            continue
        try:
            t = tokenize_conversation(tokenizer, record.messages, data.last_turn_only, record.where)
        except TemplateError as e:  # e.g. a template that insists on alternating roles
            if data.on_bad_line == "error":
                raise ValueError(f"bad input: {record.where}: the chat template refused the conversation ({e}); "
                                 "nothing was written. Fix the record, or pass data.on_bad_line=skip") from None
            counts["bad_template_error"] += 1
            continue
        if len(t.input_ids) > data.max_length:
            if data.overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            t = Tokenized(t.input_ids[: data.max_length], t.loss_mask[: data.max_length])
            counts["truncated"] += 1
        if not any(t.loss_mask):
            counts["dropped_no_trainable_tokens"] += 1
            continue
        out[split].append(t)
    return out, counts


def _shuffled(items: list, seed: str) -> list:
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order]


def write(out_dir: Path, splits: dict[str, list[Tokenized]], manifest: dict, keep: list[Path] = ()) -> None:
    """Both splits and the manifest into a temporary directory, then renamed to `out_dir`; the files of `keep`
    (in `out_dir`: the regeneration journal) go along (linked, not copied)."""
    datasets.disable_progress_bars()
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted run: never a finished dataset
    tmp.mkdir(parents=True)
    tokens = sum(len(r.input_ids) for rows in splits.values() for r in rows)
    needed = 5 * tokens + 16 * sum(len(rows) for rows in splits.values())  # int32 ids + int8 mask, row offsets
    kept = (f"the prepared data already in {out_dir} is untouched" if out_dir.exists()
            else f"nothing was written to {out_dir}")
    with space_for(tmp, needed, "the prepared data", kept, partial=[tmp]):
        for name, rows in splits.items():
            ds = datasets.Dataset.from_dict({"input_ids": [r.input_ids for r in rows],
                                             "loss_mask": [r.loss_mask for r in rows]}, features=features)
            ds.save_to_disk(str(tmp / name))
        write_json(tmp / "manifest.json", manifest)
        for f in keep:
            _link_or_copy(f, tmp / f.name)
    replace_dir(tmp, out_dir)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def split_stats(rows: list[Tokenized]) -> dict:
    return {"samples": len(rows), "tokens": sum(len(r.input_ids) for r in rows),
            "masked_tokens": sum(sum(r.loss_mask) for r in rows)}


def token_ids_sha256(splits: dict[str, list[Tokenized]]) -> str:
    """The sha256 of the token ids as written: train then val, each row its length (8 bytes) then its ids (4 bytes
    each), little-endian. Two builds with the same hash hold the same tokens (vLLM's regenerated replies may vary
    from run to run: this tells)."""
    h = hashlib.sha256()
    for name in ("train", "val"):
        for r in splits.get(name, []):
            h.update(struct.pack(f"<q{len(r.input_ids)}i", len(r.input_ids), *r.input_ids))
    return h.hexdigest()


def run(cfg: "RunConfig") -> dict:
    """`mtp-train prepare`. A stop request while the sources are read, the target loads or the samples are
    tokenized stops it at once; during regeneration after the batch in flight, its replies kept in the journal;
    during the dataset's write after the write."""
    with StopRequests("prepare", "outside a batch of replies (reading, loading the target, tokenizing)",
                      at_once=True, then="the same command goes on (regenerated replies committed to "
                                         f"{Path(cfg.run_dir) / 'data' / 'regenerate.jsonl'} are kept)"):
        return _run(cfg)


def _run(cfg: "RunConfig") -> dict:
    data = cfg.data
    out_dir = Path(cfg.run_dir) / "data"
    if not data.sources:
        raise ValueError("data.sources is empty: the recipe must name at least one source")
    synth.check_sources(data)
    for i, src in enumerate(data.sources):
        if not synth.wanted(src):
            check_exists(src, i)
    sources = [synth.describe(src) if synth.wanted(src) else file_digests(src) for src in data.sources]
    digest = config_hash(cfg, sources)
    if (out_dir / "manifest.json").is_file():
        existing = json.loads((out_dir / "manifest.json").read_text())
        if existing.get("config_hash") == digest:
            print(f"prepare: {out_dir} is up to date (same data config, seed, tokenizer and source files); "
                  "nothing to do")
            return existing
        if not data.overwrite:
            raise ValueError(f"{out_dir} holds a dataset made from another config or other source files; pass "
                             "data.overwrite=true to replace it, or use another run_dir")
    tokenizer = load_tokenizer(cfg.target.path)
    tokenizer.model_max_length = 1 << 30  # samples are cut to data.max_length here, not by the tokenizer
    t0 = time.perf_counter()
    written, prompts = {}, None
    for i, src in enumerate(data.sources):  # before reading: the prompts join the others (dedupe, limit, split)
        if synth.wanted(src):
            written[i], prompts = synth.synthesize(cfg, tokenizer, src)
    samples, manifest = collect(cfg, written)
    if data.decontaminate:  # before regenerating: no reply is written for a conversation that is dropped
        samples, manifest["decontaminate"] = decontaminate(samples, list(cfg.validate.prompts),
                                                           list(cfg.validate.test_prompts))
        print(f"prepare: {manifest['decontaminate']['dropped']} conversations overlap a held-out prompt and are "
              f"dropped (checked: {', '.join(manifest['decontaminate']['checked']) or 'none'}"
              + (f"; unchecked, not fetched: {', '.join(manifest['decontaminate']['unchecked'])}"
                 if manifest["decontaminate"]["unchecked"] else "") + ")")
    regen = None
    if data.regenerate:  # before weighting, so a repeated conversation is generated once
        rewritten, regen = regenerate(cfg, tokenizer, [(r, s) for _, r, s in samples], sources)
        samples = [(i, r, s) for (i, _, _), (r, s) in zip(samples, rewritten)]
    splits, counts = tokenize(cfg, tokenizer, weigh(cfg, samples, manifest))
    splits = {name: _shuffled(rows, f"{cfg.seed}:{name}") for name, rows in splits.items()}
    if not splits["train"]:
        raise ValueError("no training samples left after reading, filtering and splitting the sources")
    seconds = time.perf_counter() - t0
    n_samples = sum(len(rows) for rows in splits.values())
    n_tokens = sum(len(r.input_ids) for rows in splits.values() for r in rows)
    for src_report, files in zip(manifest["sources"], sources):
        src_report["files"] = files
    manifest = {
        "format_version": FORMAT_VERSION,
        "created_by": f"mtp_train {__version__}",
        "config_hash": digest,
        "tokenizer": {"path": str(Path(cfg.target.path).resolve()), "sha256": tokenizer_hash(cfg.target.path)},
        "data_config": asdict(data),
        "seed": cfg.seed,
        **manifest,
        "counts": dict(counts),
        "splits": {name: split_stats(rows) for name, rows in splits.items()},
        "token_ids_sha256": token_ids_sha256(splits),
        "target_prompts": prompts,
        "regenerate": regen,
        "throughput": {"seconds": round(seconds, 3), "samples_per_s": round(n_samples / seconds, 1),
                       "tokens_per_s": round(n_tokens / seconds, 1)},
    }
    with StopRequests("prepare", "dataset write"):  # never cut short: a request here ends a finished run
        journals = [Path(r["journal"]) for r in (prompts, regen) if r]  # none when nothing was generated
        write(out_dir, splits, manifest, keep=[j for j in journals if j.is_file()])
    print(format_summary(manifest, out_dir))
    return manifest


def format_summary(m: dict, out_dir: Path) -> str:
    lines = [f"prepare: wrote {out_dir}"]
    for name, s in m["splits"].items():
        lines.append(f"  {name:<5} {s['samples']:>7,} samples {s['tokens']:>10,} tokens "
                     f"{s['masked_tokens']:>10,} trainable")
    for src in m["sources"]:
        c = src["counts"]
        bad = {k: v for k, v in c.items() if k.startswith("bad_")}
        skipped = {k[len("skipped_"):]: v for k, v in c.items() if k.startswith("skipped_")}
        lines.append(f"  source {src['path']} ({src['format']}, {src['split']}): {c.get('records', 0)} records, "
                     f"{c.get('duplicates', 0)} duplicates, {c.get('kept', 0)} kept" + (f", bad {bad}" if bad else "")
                     + (f", skipped {skipped}" if skipped else ""))
    if m.get("target_prompts"):
        p = m["target_prompts"]
        lines.append(f"  target prompts: {p['written']} of {p['requested']} kept of {p['attempts']} sampled, "
                     "dropped " + ", ".join(f"{k} {v}" for k, v in p["dropped"].items() if v))
    if m["counts"]:
        lines.append(f"  {', '.join(f'{k} {v}' for k, v in sorted(m['counts'].items()))}")
    t = m["throughput"]
    lines.append(f"  {t['samples_per_s']:,.0f} samples/s, {t['tokens_per_s']:,.0f} tokens/s")
    return "\n".join(lines)
