"""The standard-library corpus behind the embedded tiny target.

Every Python installation carries a few tens of MB of real, varied text: its standard library. The tiny
target, its tokenizer, the draft LM and the `tiny` recipe's head data are all made from it, so the whole
pipeline runs offline.

The split rule (the one place it lives; every stage imports it):

    bucket = int(sha256(relative_posix_path).hexdigest()[:8], 16) % 100
    bucket <  80  -> "target-train"  (tokenizer, target LM and draft LM)
    bucket <  90  -> "head-train"    (draft-head training data)
    otherwise     -> "validation"    (never trained on by the target, the draft LM or any head)

The rule depends only on the file's path relative to the stdlib root, so it is stable across machines and
Python versions (a file that exists in two versions lands in the same split in both).
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("target-train", "head-train", "validation")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def split_of(relpath: str) -> str:
    """The split a stdlib file belongs to, from its POSIX path relative to the stdlib root."""
    bucket = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < 80:
        return "target-train"
    if bucket < 90:
        return "head-train"
    return "validation"


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (never site-packages)."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX path relative to the stdlib root
    split: str
    path: Path

    def read(self) -> str:
        # A few stdlib files (test data) are deliberately not UTF-8.
        return self.path.read_text(encoding="utf-8", errors="replace")


def list_files(split: str | None = None, root: Path | None = None) -> list[SourceFile]:
    """All `.py` files under the stdlib root, sorted by relative path, optionally of one split."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; expected one of {', '.join(SPLITS)}")
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {root}")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            s = split_of(rel)
            if split is None or s == split:
                files.append(SourceFile(rel, s, path))
    files.sort(key=lambda f: f.relpath)
    return files


def iter_texts(split: str, root: Path | None = None) -> Iterator[str]:
    """The texts of one split's files, in the deterministic file order."""
    for f in list_files(split, root):
        yield f.read()


SYSTEM_PROMPT = "You are a Python assistant. Write the function the user describes."


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)  # the only nodes a `def` can sit under


def _defs(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The tree's function definitions in `ast.walk`'s breadth-first order, visiting statements only: a `def`
    is never inside an expression, so skipping expressions drops no `def` and keeps the order (the records'
    `#i` numbers), at a tenth of the nodes."""
    queue = deque([tree])
    while queue:
        node = queue.popleft()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        queue.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _BLOCKS))


def function_conversations(text: str, max_chars: int = 2000) -> Iterator[list[dict[str, str]]]:
    """Chat samples cut from one source file: the user gives a function's signature and docstring, the
    assistant answers with the whole function. Files that do not parse yield nothing."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in _defs(tree):
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None:
            continue
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        source = "\n".join(lines[first - 1 : node.end_lineno])
        indent = len(source) - len(source.lstrip(" "))
        source = "\n".join(line[indent:] for line in source.splitlines())
        if len(source) > max_chars:
            continue
        prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        signature = f"{prefix} {node.name}({ast.unparse(node.args)})"
        user = f"Write `{signature}`.\n\n{doc.strip()}"
        yield [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user},
            {"role": "assistant", "content": source},
        ]
