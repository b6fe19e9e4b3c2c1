"""The directions of dependency (docs/design.md, section 10), read from every module's imports (those inside functions
too; those under `if TYPE_CHECKING:` do not count): the model never imports training or inference, inference never
imports training, nothing imports the CLI; the stages follow the pipeline data -> store -> train -> validate ->
export, none importing a later one except validate -> export's layout writers; no import cycle among library
modules; the config modules are light, and `import mtp_train.config` loads neither torch nor any stage's code."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mtp_train"
FORBIDDEN = {"model": ("mtp_train.train", "mtp_train.inference", "mtp_train.cli"),
             "inference": ("mtp_train.train", "mtp_train.cli")}
STAGES = ("data", "store", "train", "validate", "export")  # in pipeline order
LAYOUT_WRITERS = ("mtp_train.export", "mtp_train.export.config", "mtp_train.export.formats",
                  "mtp_train.export.layouts", "mtp_train.export.write", "mtp_train.export.eagle3")
LIBRARIES = ("model", "inference")  # below every stage: they import no stage


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)}


def imports(path: Path) -> set[str]:
    names = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, packages by their __init__.py."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the library modules it imports. `from a.b import c` imports a.b.c when that is a module, else a.b;
    importing a.b.c from outside a.b also imports a.b (its __init__ runs first)."""
    mods = modules(package)

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, path in mods.items():
        out = set()
        for imported in imports(path):
            target = owner(imported)
            if target is None:
                continue
            parts = target.split(".")
            out |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        edges[name] = {t for t in out if t in mods and t != name and not name.startswith(t + ".")}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


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


def test_no_import_cycle_among_library_modules():
    assert cycles(graph()) == []


def wrong_way(edges: dict[str, set[str]]) -> list[str]:
    """Imports of a later stage by a stage (validate -> export's layout writers allowed) and of a stage by a library."""
    broken = []
    for module, targets in sorted(edges.items()):
        here = _stage(module)
        for target in sorted(targets):
            there = _stage(target)
            if there is None or there == here:
                continue
            if module.split(".")[1] in LIBRARIES:
                broken.append(f"{module} (a library) imports {target} (stage {there})")
            elif here is not None and STAGES.index(there) > STAGES.index(here) and not (
                    here == "validate" and target in LAYOUT_WRITERS):
                broken.append(f"{module} (stage {here}) imports {target} (the later stage {there})")
    return broken


def test_stages_import_no_later_stage_and_libraries_no_stage():
    assert wrong_way(graph()) == []


def test_config_modules_import_only_config_modules():
    """Each stage's config.py imports only other config modules (and plain constants): composing a run config never
    runs a stage's code."""
    light = {name for name in modules() if name.endswith(".config")} | {"mtp_train", "mtp_train.model.cache"}
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    broken = [f"{name} imports {target}" for name in sorted(light) for target in sorted(graph()[name])
              if target not in light and target not in packages]
    assert broken == []
    assert all(modules()[p].read_text().count("\nimport ") + modules()[p].read_text().count("\nfrom ") == 0
               for p in packages), "a package __init__ runs whenever one of its modules is imported: keep it light"


def test_importing_the_run_config_loads_no_torch_and_no_stage():
    code = ("import sys, mtp_train.config; "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('mtp_train.train.trainer', "
            "'mtp_train.store.precompute', 'mtp_train.data.prepare', 'mtp_train.validate.run', 'mtp_train.export.run')));"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_checks_catch_a_cycle_and_a_later_stage(tmp_path):
    """The graph and its checks on a made-up package: a cycle through a function-level import is found, an import
    under TYPE_CHECKING is not counted, and a store module importing the trainer is caught."""
    pkg = tmp_path / "mtp_train"
    for sub in ("store", "train"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "store" / "a.py").write_text("def f():\n    from mtp_train.train.b import g\n")
    (pkg / "train" / "b.py").write_text("from mtp_train.store.a import f\n")
    (pkg / "train" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from mtp_train.store.d import x\n")
    (pkg / "store" / "d.py").write_text("from mtp_train.train.c import y\n")
    edges = graph(pkg)
    assert cycles(edges) == [["mtp_train.store.a", "mtp_train.train.b"]]
    assert "mtp_train.store.d" not in edges["mtp_train.train.c"]
    assert "mtp_train.train" in edges["mtp_train.store.a"]  # importing train.b runs train/__init__ first
    assert wrong_way(edges) == ["mtp_train.store.a (stage store) imports mtp_train.train (the later stage train)",
                                "mtp_train.store.a (stage store) imports mtp_train.train.b (the later stage train)",
                                "mtp_train.store.d (stage store) imports mtp_train.train (the later stage train)",
                                "mtp_train.store.d (stage store) imports mtp_train.train.c (the later stage train)"]


def test_no_module_beside_a_script_shadows_what_the_script_imports():
    """`inference/vllm_run.py` runs as a file with vLLM's Python, so its own folder comes first on its path: a module
    there named like a package it imports (a `vllm.py`) would be imported instead of vLLM."""
    script = PACKAGE / "inference" / "vllm_run.py"
    beside = {p.stem for p in script.parent.glob("*.py")} | {p.name for p in script.parent.iterdir() if p.is_dir()}
    imported = {name.split(".")[0] for name in imports(script)}
    assert "vllm" in imported and imported & beside == set()
