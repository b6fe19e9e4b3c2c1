import ast
from collections import Counter

import pytest

from mtp_train.data import stdlib


def test_split_rule_is_pinned():
    # The rule is part of the data contract: changing it would leak validation files into training.
    assert stdlib.split_of("json/decoder.py") == "target-train"
    assert stdlib.split_of("os.py") == "target-train"
    assert stdlib.split_of("collections/__init__.py") == "validation"
    assert stdlib.split_of("asyncio/tasks.py") == "validation"
    assert stdlib.split_of("base64.py") == "head-train"


def test_split_shares_on_the_real_stdlib():
    everything = stdlib.list_files()
    assert len(everything) > 500
    assert [f.relpath for f in stdlib.list_files("validation")] == [f.relpath for f in everything
                                                                   if f.split == "validation"]
    counts = Counter(f.split for f in everything)
    for split, share in (("target-train", 0.8), ("head-train", 0.1), ("validation", 0.1)):
        assert abs(counts[split] / len(everything) - share) < 0.05, counts
    assert not any("site-packages" in f.relpath for f in everything)


def test_split_depends_on_the_relative_path_only(tmp_path):
    # The same stdlib file under another root (another machine, another Python prefix) keeps its split.
    real = {f.relpath: f.split for f in stdlib.list_files()}
    for rel in ("asyncio/tasks.py", "base64.py", "json/decoder.py"):
        (tmp_path / "lib" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lib" / rel).write_text("pass\n")
    moved = stdlib.list_files(root=tmp_path / "lib")
    assert [f.relpath for f in moved] == ["asyncio/tasks.py", "base64.py", "json/decoder.py"]
    assert {f.relpath: f.split for f in moved} == {rel: real[rel] for rel in real if rel in
                                                   ("asyncio/tasks.py", "base64.py", "json/decoder.py")}
    assert {f.split for f in moved} == set(stdlib.SPLITS)


def test_corpus_reads_non_utf8_and_skips_site_packages(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "good.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "latin1.py").write_bytes(b"s = '\xe9t\xe9'\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third_party.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not python")
    files = stdlib.list_files(root=tmp_path)
    assert [f.relpath for f in files] == ["pkg/good.py", "pkg/latin1.py"]
    assert files[1].read() == "s = '\ufffdt\ufffd'\n"
    with pytest.raises(ValueError, match="unknown corpus split"):
        stdlib.list_files("train", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="stdlib directory not found"):
        stdlib.list_files(root=tmp_path / "missing")


def test_function_conversations():
    src = '''
class A:
    @staticmethod
    def add(a, b=2):
        """Add two numbers."""
        return a + b

def undocumented():
    return 1
'''
    convs = list(stdlib.function_conversations(src))
    assert len(convs) == 1
    system, user, assistant = convs[0]
    assert [m["role"] for m in convs[0]] == ["system", "user", "assistant"]
    assert user["content"] == "Write `def add(a, b=2)`.\n\nAdd two numbers."
    assert assistant["content"] == '@staticmethod\ndef add(a, b=2):\n    """Add two numbers."""\n    return a + b'
    assert list(stdlib.function_conversations("def broken(:\n")) == []


def test_function_conversations_keep_ast_walks_order():
    """`_defs` visits statements only; the conversations (and so the records' `#i` numbers and the tiny
    recipe's data) come in `ast.walk`'s order: defs under every kind of block, and the head-train split's files."""
    src = '''
def outer():
    """o"""
    def inner():
        """i"""
    class C:
        async def method(self):
            """m"""
try:
    def in_try():
        """t"""
except ImportError:
    def in_except():
        """e"""
else:
    def in_else():
        """l"""
finally:
    def in_finally():
        """f"""
if x:
    with y:
        for z in w:
            while v:
                def deep():
                    """d"""
match q:
    case 1:
        def in_case():
            """c"""
'''
    files = [src] + [f.read() for f in stdlib.list_files("head-train")[:40]]
    for text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        walked = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert list(stdlib._defs(tree)) == walked
    names = [c[1]["content"].split("(")[0] for c in stdlib.function_conversations(src)]
    assert names == ["Write `def outer", "Write `def inner", "Write `def in_try", "Write `def in_else",
                     "Write `def in_finally", "Write `async def method", "Write `def in_except",
                     "Write `def in_case", "Write `def deep"]  # breadth first: by depth, then in source order
