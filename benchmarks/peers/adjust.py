"""Run-time adjustments of a peer's trainer, recorded: the launchers (`run_speculators.py`, `run_specforge.py`) run
in the peer's own venv and change nothing on disk; each adjustment is a named replacement of one attribute, and
the record says how often each replacement was actually called, so a test can show every one was applied.
Imports nothing of mtp_train (the peers' venvs do not have it)."""

from __future__ import annotations

import functools
import importlib
import json
import time
from pathlib import Path


class Adjustments:
    def __init__(self) -> None:
        self.entries: dict[str, dict] = {}
        self.started = time.time()

    def replace(self, target: str, why: str, make):
        """Replace `module.path:attr.sub` by `make(original)`; calls of the replacement are counted under
        `target`."""
        module_name, _, attr_path = target.partition(":")
        owner = importlib.import_module(module_name)
        *parents, leaf = attr_path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        original = getattr(owner, leaf)
        entry = self.entries.setdefault(target, {"why": why, "calls": 0})
        new = make(original)

        @functools.wraps(new)
        def counted(*args, **kwargs):
            entry["calls"] += 1
            return new(*args, **kwargs)

        setattr(owner, leaf, staticmethod(counted) if isinstance(owner, type) and _is_static(owner, leaf)
                else counted)
        return original

    def note(self, name: str, why: str) -> None:
        """An adjustment that is a setting, not a replacement (a flag, a file layout): recorded as applied."""
        self.entries[name] = {"why": why, "calls": None}

    def write(self, path: Path, extra: dict | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"adjustments": self.entries, "wall_s": time.time() - self.started,
                                    **(extra or {})}, indent=1) + "\n")


def _is_static(owner: type, name: str) -> bool:
    return isinstance(owner.__dict__.get(name), staticmethod)
