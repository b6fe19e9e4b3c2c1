"""Where fetched pretrained targets live on this machine: one rule, shared by the fetch scripts under
`data_prep/` (which write there) and the recipes' `${models:NAME}` paths (which read from there)."""

from __future__ import annotations

import os
from pathlib import Path

MODELS_ENV = "MTP_TRAIN_MODELS"


def models_dir() -> Path:
    """`$MTP_TRAIN_MODELS` if set (a shared disk, a cluster scratch), else `~/.cache/mtp_train/models`.

    Not created here: a reader that finds nothing should say which fetch script to run, not get an empty
    directory."""
    env = os.environ.get(MODELS_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mtp_train" / "models"


# name under models_dir() -> the command that fetches and converts it (said when the directory is missing)
FETCH_COMMANDS = {
    "smollm2-135m-instruct": "make smollm2-fetch  (or: python data_prep/fetch_smollm2.py)",
}


def model_path(name: str) -> str:
    """The recipes' `${models:NAME}`: models_dir() / NAME, whether or not it has been fetched yet (a recipe
    must compose before its target exists; the stage that reads it says how to fetch it)."""
    return str(models_dir() / name)


def fetch_hint(path: str | Path) -> str:
    """' Fetch it with: ...' when `path` is a known model's place under models_dir(), else ''."""
    p = Path(path).expanduser()
    command = FETCH_COMMANDS.get(p.name) if p.parent == models_dir() else None
    return f". Fetch and convert it with: {command}" if command else ""
