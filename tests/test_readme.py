"""The manual stays honest: every `mtp-train` command in the shell blocks of README.md and docs/*.md resolves its
config (`--cfg`) without error, every relative link in them leads to a file (and heading) that exists, and the
README stays a short manual (at most 300 lines).

A command is found in the forms a user types: `mtp-train <stage> ...` (any path to the script),
`python -m mtp_train <stage> ...`, `torchrun ... -m mtp_train <stage> ...`, the launchers in `launch/` (their
arguments go to a stage unchanged; `sbatch ... launch/slurm_multinode.sbatch` too, `STAGE=` respected) and
`python -m mtp_train.train.memory ...` (which composes the same config). Lines are joined at `\\`
continuations, comments are dropped, shell variables assigned earlier on the page (`R="recipe=... run_dir=..."`)
and one-line `for X in a b; do ...; done` loops are expanded. Placeholders are written `<like-this>`: an
argument that holds one is dropped, except `target.path=<...>`, which a recipe may require and which becomes
the embedded tiny target (`--cfg` reads no weights); a synopsis (`mtp-train <stage> ...`) is no command.
Blocks marked `text`, `python`, `yaml` (anything but a shell) are not read."""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtp_train.cli import STAGES, TOOLS, main
from mtp_train.config import ASSETS_DIR

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
MAX_LINES = 300

PLACEHOLDER = re.compile(r"<[A-Za-z0-9][A-Za-z0-9._/|-]*>")
FENCE = re.compile(r"^```(\w*)\s*$")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
FOR_LOOP = re.compile(r"^\s*for ([A-Za-z_][A-Za-z0-9_]*) in ([^;]*); do (.*?);? done\b(.*)$")
ENVIRONMENT = {"PWD", "HOME", "USER"}  # the shell's own: left as they are
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
LAUNCHERS = {"launch/train_single_node.sh": "train", "launch/precompute_single_node.sh": "precompute",
             "launch/pipeline.sh": "pipeline", "launch/slurm_multinode.sbatch": "train"}
MEMORY_MODULE = "mtp_train.train.memory"
MEMORY_FLAGS = ("--world", "--gpu-gib")  # flags with a value that memory's main takes beside key=value
TINY_TARGET = str(ASSETS_DIR / "tiny" / "target")


@dataclass
class Command:
    line: str  # as the page has it (continuations joined)
    stage: str  # a stage of the CLI, a tool (verify-store), or MEMORY_MODULE
    args: list[str]  # placeholders already handled


def shell_lines(text: str) -> list[str]:
    """The logical lines of the text's shell code blocks, in order: continuations joined."""
    lines, block, pending = [], None, ""
    for raw in text.splitlines():
        fence = FENCE.match(raw.strip())
        if fence:
            block = None if block is not None else fence.group(1)
            pending = ""
            continue
        if block is None or block not in SHELL_BLOCKS:
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    return lines


def words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def expand(line: str, variables: dict[str, str]) -> str:
    """$NAME and ${NAME} replaced by their text, outside single quotes, before the line is split into words:
    an unquoted variable splits at its spaces, as in the shell."""
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in ENVIRONMENT:
            return m.group(0)
        if name not in variables:
            raise KeyError(f"${name} is used before the page assigns it: {line.strip()}")
        return variables[name]

    parts = re.split(r"('[^']*')", line)
    return "".join(p if p.startswith("'") else VARIABLE.sub(value, p) for p in parts)


def simple_commands(tokens: list[str]) -> list[list[str]]:
    out, cur = [], []
    for t in tokens:
        if t in SEPARATORS:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return [c for c in [*out, cur] if c]


def placeholders_handled(args: list[str]) -> list[str]:
    out = []
    for a in args:
        if not PLACEHOLDER.search(a):
            out.append(a)
        elif a.startswith("target.path="):
            out.append(f"target.path={TINY_TARGET}")
    return out


def module_after_m(rest: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of `python -m X ...`; past torch.distributed.run (torchrun), the module it runs."""
    k = -1
    while "-m" in rest[k + 1:]:
        k = rest.index("-m", k + 1)
        if k + 1 < len(rest) and rest[k + 1] != "torch.distributed.run":
            return rest[k + 1], rest[k + 2:]
    return None


def as_command(cmd: list[str], line: str) -> Command | None:
    """The CLI invocation in one simple command, or None when it runs something else."""
    env = {}
    while cmd and ASSIGNMENT.match(cmd[0]):  # GPUS_PER_PROCESS=2 launch/...
        key, value = cmd[0].split("=", 1)
        env[key] = value
        cmd = cmd[1:]
    if not cmd:
        return None
    prog, rest = cmd[0], cmd[1:]
    if prog in ("sbatch", "bash"):  # sbatch [options] SCRIPT args...
        script = next((i for i, w in enumerate(rest) if w.removeprefix("./") in LAUNCHERS), None)
        if script is None:
            return None
        prog, rest = rest[script], rest[script + 1:]
    if prog.removeprefix("./") in LAUNCHERS:
        return Command(line, env.get("STAGE", LAUNCHERS[prog.removeprefix("./")]), placeholders_handled(rest))
    if Path(prog).name == "mtp-train":  # `mtp-train <stage> ...` is a synopsis, not a command
        if not rest or PLACEHOLDER.search(rest[0]) or rest[0].startswith("-"):
            return None
        return Command(line, rest[0], placeholders_handled(rest[1:]))
    if Path(prog).name.startswith("python") or Path(prog).name == "torchrun":
        found = module_after_m(rest)
        if found is None:
            return None
        module, tail = found
        if module == "mtp_train" and tail and not tail[0].startswith("-"):
            return Command(line, tail[0], placeholders_handled(tail[1:]))
        if module == MEMORY_MODULE:
            return Command(line, MEMORY_MODULE, placeholders_handled(tail))
    return None


def commands(text: str) -> list[Command]:
    """Every CLI command in the text's shell blocks, with the variables assigned before it expanded."""
    variables: dict[str, str] = {}
    found = []

    def read(line: str, shown: str) -> None:
        loop = FOR_LOOP.match(line)
        if loop:
            name, values, body, after = loop.groups()
            for value in words(expand(values, variables)):
                read(expand(body, {**variables, name: value}), shown)
            if after.strip():
                read(after, shown)
            return
        tokens = words(expand(line, variables))
        if len(tokens) == 1 and ASSIGNMENT.match(tokens[0]):  # R="recipe=... run_dir=..."
            key, value = tokens[0].split("=", 1)
            variables[key] = value
            return
        for cmd in simple_commands(tokens):
            c = as_command(cmd, shown)
            if c is not None:
                found.append(c)

    for line in shell_lines(text):
        read(line, line)
    return found


def resolve(c: Command, capsys) -> tuple[int, str]:
    """The command's config resolved in-process: (exit code, what it printed to stderr)."""
    if c.stage == MEMORY_MODULE:
        from mtp_train.config import ConfigError, compose

        if importlib.util.find_spec(MEMORY_MODULE) is None:
            return 2, f"no module {MEMORY_MODULE}"

        args = list(c.args)
        for flag in MEMORY_FLAGS:
            if flag in args:
                k = args.index(flag)
                del args[k:k + 2]
        recipe = next((a.split("=", 1)[1] for a in args if a.startswith("recipe=")), "tiny")
        if not any(a.startswith("run_dir=") for a in args):
            args.append("run_dir=unused")
        try:
            compose(recipe, args)
        except ConfigError as e:
            return 2, str(e)
        return 0, ""
    if c.stage in TOOLS:  # verify-store DIR: a path, no config
        return (0, "") if len(c.args) == 1 else (2, f"{c.stage} takes one directory")
    if c.stage not in STAGES:
        return 2, f"unknown stage {c.stage!r}"
    code = main([c.stage, *c.args, "--cfg"])
    return code, capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------

FOUND = [(page, c) for page in PAGES for c in commands(page.read_text())]


def test_the_readme_is_a_short_manual():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; keep it at {MAX_LINES} or fewer and move the rest to docs/"


def test_the_readme_walks_through_every_stage():
    """The extraction finds the walk-through, so an empty list cannot pass for an honest README."""
    stages = {c.stage for page, c in FOUND if page == README}
    missing = {"prepare", "precompute", "train", "validate", "export"} - stages
    assert not missing, f"no README command runs {sorted(missing)}"


@pytest.mark.parametrize("page,command", FOUND,
                         ids=[f"{p.relative_to(REPO)}:{c.stage}:{' '.join(c.args)[:50]}" for p, c in FOUND])
def test_every_command_resolves_its_config(page, command, capsys):
    code, err = resolve(command, capsys)
    assert code == 0, (f"{page.relative_to(REPO)}: {command.line.strip()}\n"
                       f"  ran as: {command.stage} {' '.join(command.args)} --cfg\n  {err}")


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((i, line))
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    broken = []
    for i, line in prose(page.read_text()):
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(root)}:{i}: {target} does not exist")
            elif fragment and dest.suffix == ".md" and fragment not in {
                    anchor(h.lstrip("#")) for _, h in prose(dest.read_text()) if h.startswith("#")}:
                broken.append(f"{page.relative_to(root)}:{i}: {target}: no such heading")
    return broken


def test_every_link_resolves():
    """README -> docs -> code: a file that moves or a heading that is renamed breaks no link unseen."""
    assert [b for page in PAGES for b in broken_links(page)] == []


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "x.md"
    page.write_text("# Top\n[a](x.md#top) [b](nowhere.md) [c](#bottom) [d](https://example.com)\n"
                    "```\n[e](no.md)\n```\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page, tmp_path)] == [
        "nowhere.md does not exist", "#bottom: no such heading"]


SAMPLE = """
Some text.

```bash
R="recipe=tiny run_dir=runs/x"
mtp-train train $R train.steps=3 \\
    train.lr=1e-3        # a comment
GPUS_PER_PROCESS=2 launch/precompute_single_node.sh $R && mtp-train verify-store runs/x/store
torchrun --standalone --nproc_per_node=2 -m mtp_train train $R 'validate.prompts=[recipe,mt-bench]'
mtp-train export recipe=llama3.1-8b target.path=<path-to-your-model> run_dir=runs/y checkpoint=<a-checkpoint>
python -m mtp_train.train.memory $R --world 8
STAGE=precompute sbatch --nodes=2 launch/slurm_multinode.sbatch $R
for stage in prepare export; do .venv/bin/mtp-train $stage $R head.variant=mtp; done
ln -s "$PWD/runs/a" runs/b; echo mtp-train is not run here
```

```text
mtp-train <stage> [recipe=<name|file.yaml>] [key=value ...]
```

```python
mtp-train train this is python, not shell
```
"""


def test_the_extraction_reads_each_form():
    found = commands(SAMPLE)
    x = ["recipe=tiny", "run_dir=runs/x"]
    assert [(c.stage, c.args) for c in found] == [
        ("train", [*x, "train.steps=3", "train.lr=1e-3"]),
        ("precompute", x),
        ("verify-store", ["runs/x/store"]),
        ("train", [*x, "validate.prompts=[recipe,mt-bench]"]),
        ("export", ["recipe=llama3.1-8b", f"target.path={TINY_TARGET}", "run_dir=runs/y"]),
        (MEMORY_MODULE, [*x, "--world", "8"]),
        ("precompute", x),
        ("prepare", [*x, "head.variant=mtp"]),
        ("export", [*x, "head.variant=mtp"]),
    ]


def test_a_broken_command_is_caught(capsys):
    """The check can fail: an unknown key, a misspelt recipe or stage, a wrong type, an undefined variable."""
    broken = """
```bash
mtp-train train recipe=tiny run_dir=runs/x train.no_such_key=1
mtp-train train recipe=no-such-recipe run_dir=runs/x
mtp-train trian recipe=tiny run_dir=runs/x
launch/train_single_node.sh recipe=tiny run_dir=runs/x train.steps=many
python -m mtp_train.train.memory recipe=tiny head.no_such_key=1
```
"""
    found = commands(broken)
    assert len(found) == 5
    for c in found:
        code, _ = resolve(c, capsys)
        assert code != 0, c.line
    with pytest.raises(KeyError, match=r"\$R is used before"):
        commands("```bash\nmtp-train train $R\n```\n")
