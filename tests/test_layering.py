"""DESIGN §10's directions of dependency, read from every module's imports (those inside functions too): the
model never imports training or inference, inference never imports training, nothing imports the CLI."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mtp_train"
FORBIDDEN = {"model": ("mtp_train.train", "mtp_train.inference", "mtp_train.cli"),
             "inference": ("mtp_train.train", "mtp_train.cli")}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_the_directions_of_dependency_hold():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        forbidden = FORBIDDEN.get(rel.parts[0], ()) if len(rel.parts) > 1 else ()
        if rel != Path("cli.py") and rel != Path("__main__.py"):
            forbidden += ("mtp_train.cli",)
        broken += [f"{rel} imports {name}" for name in sorted(imports(path))
                   if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert broken == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from mtp_train.train.checkpoint import read_head\n")
    assert "mtp_train.train.checkpoint.read_head" in imports(f)
