"""`mtp-train verify-store DIR`: recheck a store against its manifest and name every bad shard.

DIR is a split directory (holding manifest.json) or a store directory holding split directories
(`run_dir/store` with train/ and val/). Each shard is checked for: presence, size, sha256 of the whole
file, a tensor table that safetensors itself parses with the names, dtypes and shapes the manifest
implies, offsets that start at 0, never decrease and end at the token count, the masked-token count, and
the plan digest that ties it to its manifest. Totals are checked against the shards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from mtp_train.files import sha256_file
from mtp_train.store.format import (MANIFEST, PARTIAL, read_header, read_manifest, shard_layout_problems,
                                    shard_plan_hash)


@dataclass(frozen=True)
class ShardCheck:
    name: str  # split/shard file
    problem: str | None  # None: the shard is good
    samples: int
    tokens: int


def _is_split(d: Path) -> bool:
    """A store split: an unfinished one, or a manifest.json that is a store's (a prepared dataset has one too)."""
    if (d / PARTIAL).is_dir():
        return True
    try:
        return "plan_hash" in json.loads((d / MANIFEST).read_text())
    except OSError:
        return False
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True  # a damaged store manifest: verify_split reports it


def find_splits(path: str | Path) -> list[Path]:
    """The split directories under `path`: itself when it is one, else its subdirectories that are."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"store directory not found: {p}")
    if _is_split(p):
        return [p]
    splits = sorted(d for d in p.iterdir() if d.is_dir() and _is_split(d))
    if not splits:
        raise FileNotFoundError(f"{p} holds no store: expected a store's {MANIFEST} in it or in its split "
                                "directories (run_dir/store/train, run_dir/store/val)")
    return splits


def check_shard(split_dir: Path, manifest: dict, shard: dict) -> str | None:
    """The first thing wrong with one shard, or None."""
    path = split_dir / shard["file"]
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != shard["bytes"]:
        return f"size {size:,} bytes, the manifest says {shard['bytes']:,}"
    digest = sha256_file(path)
    if digest != shard["sha256"]:
        return (f"sha256 {digest[:16]}…, the manifest says {shard['sha256'][:16]}… (the file changed after it was "
                "written)")
    try:
        entries, metadata = read_header(path)
        with safe_open(str(path), framework="pt") as f:  # safetensors' own parser must accept it too
            if sorted(f.keys()) != sorted(entries):
                return "safetensors and the header disagree on the tensor names"
            offsets, mask = f.get_tensor("offsets"), f.get_tensor("loss_mask")
    except (ValueError, SafetensorError, KeyError) as e:
        return f"unreadable: {e}"
    problems = shard_layout_problems(path, entries, manifest, shard)
    if problems:
        return problems[0]
    if shard_plan_hash(metadata) != manifest["plan_hash"]:
        return "written for another plan (plan_hash differs from the manifest's): a shard of another store"
    if int(offsets[0]) != 0 or int(offsets[-1]) != shard["tokens"] or bool((offsets[1:] < offsets[:-1]).any()):
        return f"offsets do not run from 0 to {shard['tokens']} without decreasing"
    if int(mask.sum()) != shard["masked_tokens"]:
        return f"{int(mask.sum())} masked tokens, the manifest says {shard['masked_tokens']}"
    return None


def verify_split(split_dir: Path) -> tuple[list[ShardCheck], list[str]]:
    """Per-shard results and split-level problems (unreadable manifest, totals that do not add up)."""
    try:
        manifest = read_manifest(split_dir)
    except (OSError, ValueError) as e:
        return [], [str(e)]
    checks = [ShardCheck(f"{split_dir.name}/{s['file']}", check_shard(split_dir, manifest, s), s["samples"],
                         s["tokens"]) for s in manifest["shards"]]
    problems = []
    totals = manifest["totals"]
    for key in ("samples", "tokens"):
        total = sum(s[key] for s in manifest["shards"])
        if totals.get(key) != total:
            problems.append(f"{split_dir.name}: totals.{key} is {totals.get(key)}, the shards add up to {total}")
    return checks, problems


def verify_store(path: str | Path, out: Callable[[str], None] = print) -> bool:
    """Check every split under `path`, print a line per shard and a summary; True when all is good."""
    splits = find_splits(path)
    bad, n = [], 0
    for split_dir in splits:
        checks, problems = verify_split(split_dir)
        for c in checks:
            n += 1
            if c.problem is None:
                out(f"  OK   {c.name}  {c.samples:,} samples, {c.tokens:,} tokens")
            else:
                out(f"  BAD  {c.name}: {c.problem}")
                bad.append(c.name)
        for p in problems:
            out(f"  BAD  {p}")
            bad.append(split_dir.name)
    if bad:
        out(f"store {path}: BAD: {len(bad)} problem(s) in {', '.join(dict.fromkeys(bad))}; remove the bad shard "
            "files and rerun `mtp-train precompute` with the same recipe, which redoes missing shards")
    else:
        out(f"store {path}: OK ({len(splits)} split(s), {n} shard(s))")
    return not bad
