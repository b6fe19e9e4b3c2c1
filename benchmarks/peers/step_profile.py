"""Where a trainer's optimizer steps go: a window of steps run under torch's profiler, its time split into named
categories (the attention, the loss), forward and backward, so that a speed ratio can be given with a category's
time taken out (issue 56: the peers' CPU attention fallback and eager loss).

A category is a set of scopes: functions (`module:attr.path`, replaced by the same function run inside a
`record_function`), modules whose class name matches a regular expression, and modules registered in their parent
under a name that matches one (e.g. `lm_head`; both through torch's global forward hooks). Its forward time is
the time inside its outermost scopes; its backward time is the time of the autograd nodes that the operations
inside those scopes created (the profiler's sequence numbers tie each backward node to the forward operation it
differentiates). A run may have several windows (e.g. one in each epoch); a window's wall time is from the end
of step `first - 1` to the end of step `last`; steps are counted by torch's global optimizer hook (a trainer that
steps several optimizers a step is counted by its first one). Each window's record also holds the unprofiled steps
before it (after the previous window), so the profiler's own overhead shows (`overhead`: the window's mean step
time over theirs).

Used by the peers' launchers (`run_speculators.py`, `run_specforge.py`, in the peers' own venvs) and, for ours,
as a wrapper around `python -m mtp_train train ...`:

    python benchmarks/peers/step_profile.py --window 6 15 --out PROFILE.json --trainer ours -- -m mtp_train train ...

(`--trainer T` takes T's categories from CATEGORIES; `--function`, `--module`, `--name` give others; `--window`
again adds a window.)

Imports nothing of mtp_train (the peers' venvs do not have it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import re
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

PREFIX = "scope::"
BACKWARD = "autograd::engine::evaluate_function: "


# Each trainer's categories (issue 56, item 6). `attention`: the decoder layer's attention module (projections,
# rotary, the product with the keys of every TTT step, forward and backward) and the building of its mask; on a CPU
# the peers run their fallbacks here (speculators: sdpa over a dense mask of its packed row, widened every TTT step;
# SpecForge: its sdpa backend). `loss`: the loss over the vocabulary with the projections that feed it, the draft's
# lm_head and the target's (ours computes both inside its fused loss, `head_loss`, so the peers' count them too); on
# a CPU the peers run their eager losses here (their fused ones need Triton).
CATEGORIES = {
    "ours": {"functions": {"loss": ["mtp_train.train.trainer:head_loss"]},
             "modules": {"attention": "Attention$"}, "names": {}},
    "speculators": {
        "functions": {"attention": ["speculators.models.eagle3.core:Eagle3DraftModel._build_attn_mask",
                                    "speculators.models.eagle3.core:extend_dense_mask_for_draft_tokens"],
                      "loss": ["speculators.models.eagle3.core:compute_metrics"]},
        "modules": {"attention": "Attention$"}, "names": {"loss": "lm_head|verifier_lm_head"}},
    "specforge": {
        "functions": {"attention": ["specforge.modeling.draft.llama3_eagle:prepare_decoder_attention_mask",
                                    "specforge.modeling.draft.base:Eagle3DraftModel.prepare_decoder_attention_mask"],
                      "loss": ["specforge.algorithms.eagle3.model:_compute_loss_and_acceptance_rate",
                               "specforge.algorithms.eagle3.model:_compute_target_p_padded",
                               "specforge.algorithms.eagle3.model:compute_target_p_padded_from_hidden"]},
        "modules": {"attention": "Attention$", "loss": "^TargetHead$"}, "names": {"loss": "lm_head"}},
}


def for_trainer(trainer: str, windows: list[tuple[int, int]]) -> "StepProfile":
    """The profile of `trainer`'s steps in `windows` ((first, last), ...) with its categories (CATEGORIES),
    installed."""
    c = CATEGORIES[trainer]
    return StepProfile(windows, c["functions"], c["modules"], c["names"]).install()


def windows_of(flat: list) -> list[tuple[int, int]]:
    """[FIRST, LAST, FIRST, LAST, ...] (a command line's) -> [(first, last), ...]"""
    if len(flat) % 2 or not flat:
        raise ValueError(f"profile windows {flat}: give FIRST LAST pairs")
    return [(int(a), int(b)) for a, b in zip(flat[::2], flat[1::2])]


@contextlib.contextmanager
def profiled(trainer: str, spec: list | None):
    """A launcher's `--profile OUT FIRST LAST [FIRST LAST ...]`: `trainer`'s steps in those windows profiled while
    the block runs, the record written to OUT however the block ends; nothing when spec is None."""
    if spec is None:
        yield None
        return
    out = Path(spec[0])
    prof = for_trainer(trainer, windows_of(spec[1:]))
    try:
        yield prof
    finally:
        prof.remove()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"trainer": trainer, **prof.record()}, indent=1) + "\n")

class StepProfile:
    def __init__(self, windows: list[tuple[int, int]], functions: dict[str, list[str]] | None = None,
                 modules: dict[str, str] | None = None, names: dict[str, str] | None = None) -> None:
        self.windows = [(int(a), int(b)) for a, b in windows]
        previous = None
        for first, last in self.windows:
            if not (2 if previous is None else previous + 2) <= first <= last:
                raise ValueError(f"windows {self.windows}: give windows in order, each with 2 <= first <= last and "
                                 "an unprofiled step between two windows (step 1 is warm-up, and the steps before "
                                 "a window are its unprofiled reference)")
            previous = last
        self.functions, self.modules = functions or {}, {c: re.compile(p) for c, p in (modules or {}).items()}
        self.names = {c: re.compile(p) for c, p in (names or {}).items()}
        self._named: dict[int, str] = {}  # id of a module registered under a matching name -> its category
        self._seen: set[int] = set()  # modules whose children were looked at
        self.step_end: list[float] = []
        self.profiler = None
        self.results: list[dict] = []
        self._optimizer = None
        self._open: dict[int, list] = {}
        self._undo: list = []  # how remove() puts back what install() changed

    # -- installing the scopes and the step counter ---------------------------------------------------------------
    def install(self) -> "StepProfile":
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        for category, targets in self.functions.items():
            for target in targets:
                self._scope_function(category, target)
        if self.modules or self.names:
            self._undo.append(torch.nn.modules.module.register_module_forward_pre_hook(self._module_enter).remove)
            self._undo.append(torch.nn.modules.module.register_module_forward_hook(self._module_exit).remove)
        self._undo.append(register_optimizer_step_post_hook(self._stepped).remove)
        return self

    def remove(self) -> None:
        """Undo install() (the hooks and the replaced functions); a profiler still running is stopped."""
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
        while self._undo:
            self._undo.pop()()

    def _scope_function(self, category: str, target: str) -> None:
        from torch.profiler import record_function

        module_name, _, path = target.partition(":")
        owner = importlib.import_module(module_name)
        *parents, leaf = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        original = owner.__dict__[leaf] if isinstance(owner, type) else getattr(owner, leaf)
        wrapped = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original

        @functools.wraps(wrapped)
        def scoped(*args, **kwargs):
            with record_function(PREFIX + category):
                return wrapped(*args, **kwargs)

        setattr(owner, leaf, type(original)(scoped) if isinstance(original, (staticmethod, classmethod)) else scoped)
        self._undo.append(lambda: setattr(owner, leaf, original))

    def _category_of(self, module) -> str | None:
        if id(module) in self._named:
            return self._named[id(module)]
        name = type(module).__name__
        return next((c for c, p in self.modules.items() if p.search(name)), None)

    def _module_enter(self, module, args) -> None:
        if self.names and id(module) not in self._seen:  # a parent runs before its children: tag them by name
            self._seen.add(id(module))
            for child_name, child in module.named_children():
                if (category := next((c for c, p in self.names.items() if p.fullmatch(child_name)), None)):
                    self._named[id(child)] = category
        if self.profiler is None or (category := self._category_of(module)) is None:
            return
        from torch.profiler import record_function

        scope = record_function(PREFIX + category)
        scope.__enter__()
        self._open.setdefault(id(module), []).append(scope)

    def _module_exit(self, module, args, output) -> None:
        stack = self._open.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    def _stepped(self, optimizer, args, kwargs) -> None:
        if self._optimizer is None:
            self._optimizer = optimizer
        if optimizer is not self._optimizer:
            return  # another optimizer of the same step
        self.step_end.append(time.perf_counter())
        done = len(self.step_end)
        if self.profiler is None and any(done == first - 1 for first, _ in self.windows):
            self._start()
        elif self.profiler is not None and any(done == last for _, last in self.windows):
            self._stop()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.profiler.__enter__()

    def _stop(self) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        for stack in self._open.values():  # a scope left open by a module whose forward raised
            stack.clear()
        first, last = self.windows[len(self.results)]
        since = self.windows[len(self.results) - 1][1] + 1 if self.results else 1  # the unprofiled steps before it
        self.results.append(summarize(profiler.events(), self.step_end, first, last, since))

    # -- the record -----------------------------------------------------------------------------------------------
    def record(self) -> dict:
        scopes = {"functions": self.functions, "modules": {c: p.pattern for c, p in self.modules.items()},
                  "names": {c: p.pattern for c, p in self.names.items()}}
        rec = {"windows": [list(w) for w in self.windows], "steps_made": len(self.step_end), "scopes": scopes,
               "results": self.results}
        if len(self.results) < len(self.windows):
            missed = self.windows[len(self.results)]
            rec["error"] = f"the run made {len(self.step_end)} steps: the window {missed[0]}..{missed[1]} was not " \
                           "reached"
        return rec


def summarize(events, step_end: list[float], first: int, last: int, since: int = 1) -> dict:
    """The window first..last's time by category (see the module's docstring) from the profiler's events; the
    unprofiled reference is steps since+1..first-1."""
    wall = step_end[last - 1] - step_end[first - 2]
    before = [step_end[i] - step_end[i - 1] for i in range(since, first - 1)]  # steps since+1..first-1
    forward, backward = defaultdict(float), defaultdict(float)
    created: dict[str, set] = defaultdict(set)
    for e in events:
        if not e.name.startswith(PREFIX):
            continue
        category = e.name[len(PREFIX):]
        parent, nested = e.cpu_parent, False
        while parent is not None:
            nested |= parent.name == e.name
            parent = parent.cpu_parent
        if nested:
            continue  # inside an outer scope of its category, counted there
        forward[category] += e.cpu_time_total / 1e6
        stack = list(e.cpu_children)
        while stack:
            child = stack.pop()
            if child.sequence_nr >= 0:
                created[category].add((child.thread, child.sequence_nr))
            stack.extend(child.cpu_children)
    for e in events:
        if e.name.startswith(BACKWARD) and e.sequence_nr >= 0:
            key = (getattr(e, "fwd_thread", None) or e.thread, e.sequence_nr)
            for category, keys in created.items():
                if key in keys:
                    backward[category] += e.cpu_time_total / 1e6
    top = sorted(((e.key, e.self_cpu_time_total / 1e6) for e in events.key_averages()), key=lambda x: -x[1])
    steps = last - first + 1
    categories = {c: {"forward_s": forward[c], "backward_s": backward[c],
                      "share": (forward[c] + backward[c]) / wall if wall > 0 else None}
                  for c in sorted(set(forward) | set(created))}
    return {"window": [first, last], "wall_s": wall, "step_s": wall / steps,
            "step_s_before": (sum(before) / len(before)) if before else None,
            "overhead": (wall / steps) / (sum(before) / len(before)) if before else None,
            "categories": categories,
            "share_total": sum(c["share"] or 0 for c in categories.values()),
            "top_self_ops": [{"op": k, "self_s": round(s, 6), "share": s / wall} for k, s in top[:15]]}


def kernel_ratios(ratio: float, share_ours: float, share_peer: float) -> dict[str, float]:
    """A speed ratio (ours' tokens/s over a peer's) with the profiled categories' shares of each side's step
    (attention and loss, where a peer on a CPU runs fallbacks) set equal three ways: `peer_kernels_out`, the peer's
    share taken out of its time (as if its fallbacks cost nothing: a bound in the peer's favour); `kernels_out`,
    both sides' taken out (the rest of the step); `peer_with_ours`, the peer's share replaced by ours' time in the
    same categories (per token: its time less its share, plus ours' share of ours' time)."""
    rest = ratio * (1 - share_peer)
    return {"peer_kernels_out": rest, "kernels_out": rest / (1 - share_ours), "peer_with_ours": rest + share_ours}


def parse_scopes(pairs: list[str], what: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for pair in pairs:
        category, sep, value = pair.partition("=")
        if not sep or not category or not value:
            raise SystemExit(f"step_profile.py: {what} {pair!r}: give CATEGORY=VALUE")
        out[category].append(value)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, nargs=2, action="append", required=True, metavar=("FIRST", "LAST"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--trainer", choices=sorted(CATEGORIES), help="that trainer's categories (CATEGORIES)")
    ap.add_argument("--function", action="append", default=[], help="CATEGORY=module:attr.path")
    ap.add_argument("--module", action="append", default=[], help="CATEGORY=REGEX on a module's class name")
    ap.add_argument("--name", action="append", default=[],
                    help="CATEGORY=REGEX matching the whole name a module has in its parent")
    ap.add_argument("program", nargs=argparse.REMAINDER, help="-- -m MODULE ARGS... or -- SCRIPT ARGS...")
    args = ap.parse_args()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        ap.error("give the program to run after --: -m MODULE ARGS... or SCRIPT ARGS...")
    if args.trainer:
        prof = for_trainer(args.trainer, args.window)
    else:
        modules = {c: "|".join(v) for c, v in parse_scopes(args.module, "--module").items()}
        names = {c: "|".join(v) for c, v in parse_scopes(args.name, "--name").items()}
        prof = StepProfile(args.window, parse_scopes(args.function, "--function"), modules, names).install()
    try:
        if program[0] == "-m":
            sys.argv = [program[1], *program[2:]]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = program
            runpy.run_path(program[0], run_name="__main__")
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(prof.record(), indent=1) + "\n")


if __name__ == "__main__":
    main()
