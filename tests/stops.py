"""A real `mtp-train` process that receives a stop signal at a chosen point of its start-up: `at` names a
function ("module:Class.attr" or "module:attr") that, when the process calls it, sends the signal to its own
process before doing its work, so the signal lands exactly there (loading the target, building the engine,
the step-0 evaluation) however fast or slow the machine is."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

PATCH = """
import functools, importlib, os, signal, sys
module, _, name = {at!r}.partition(":")
owner = importlib.import_module(module)
*path, attr = name.split(".")
for p in path:
    owner = getattr(owner, p)
original = getattr(owner, attr)

@functools.wraps(original)
def signalled(*args, **kwargs):
    print("stops: signalling in {at}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.{sig})
    return original(*args, **kwargs)

setattr(owner, attr, signalled)
from mtp_train.cli import main
sys.exit(main({args!r}))
"""


def signalled_run(args: list[str], at: str, sig: str = "SIGTERM", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", PATCH.format(at=at, sig=sig, args=args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
