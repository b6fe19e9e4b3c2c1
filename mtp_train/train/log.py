"""One rank-0 logger: console, `run_dir/metrics.jsonl`, and wandb when a project is configured.

wandb runs offline unless an API key is available (WANDB_API_KEY or a prior `wandb login`), so a run never
needs the network; `wandb sync run_dir/wandb/offline-run-*` uploads it later.
"""

from __future__ import annotations

import json
import netrc
import os
import time
from pathlib import Path
from urllib.parse import urlparse


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool = True, wandb_project: str = "", wandb_name: str = "",
                 config: dict | None = None, resume: bool = False, resume_step: int = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():  # a fresh run starts a fresh log; the old one is kept
            self.path.rename(self.path.with_name(f"metrics.{int(time.time())}.jsonl"))
        elif resume and self.path.exists():  # rows logged after the checkpoint are logged again: drop them
            rows = self.path.read_text().splitlines(keepends=True)
            kept = [r for r in rows if _step_of(r) is not None and _step_of(r) <= resume_step]
            if len(kept) != len(rows):
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(kept))
                os.replace(tmp, self.path)
        if wandb_project:
            import wandb

            has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
            mode = os.environ.get("WANDB_MODE") or ("online" if has_key else "offline")
            self.wandb = wandb.init(project=wandb_project, name=wandb_name or None, config=config or {},
                                    dir=str(run_dir), mode=mode, resume="allow" if resume else None)

    def log(self, record: dict, step: int, console: str | None = None) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time(), 3), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if console:
            print(console, flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _netrc_has_wandb() -> bool:
    """`wandb login` stores its key in ~/.netrc under api.wandb.ai (or WANDB_BASE_URL's host); a netrc
    holding only other machines' logins is not a key."""
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def _step_of(row: str) -> int | None:
    """The step of a metrics.jsonl row; None for a line cut short by a killed process."""
    try:
        return int(json.loads(row)["step"])
    except (ValueError, KeyError, TypeError):
        return None
