"""CPU training with subnormal floats flushed to zero (x86 FTZ / DAZ), on every thread that computes.

The chained softmaxes of a training step make subnormal probabilities (exp(log q) below 1.2e-38) once a head
grows confident, and every product that reads them then runs on the processor's slow path: on SmolLM2 an
eagle3 step of 8 × 512 tokens went from 5.5 s to 8.9 s in the middle of training (2 Xeon cores). A flushed
value is below 1.2e-38 in magnitude, far below what the float32 sums of a loss and its gradient resolve.

The flush is a per-thread register (MXCSR): `torch.set_flush_denormal` sets the calling thread's only, while
the products run on the OpenMP pool's threads too, which copied the register when they were made. So the pool
is asked to set it as well: one parallel region of the OpenMP runtime torch uses (libgomp), each of its threads
setting its own. Where that runtime is not found the main thread's alone is set (and `applied` says so).
The target's forward (online features) runs with subnormals `kept`, so its states are precompute's, bit for bit.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from pathlib import Path

import torch

_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_flushing = [False]  # whether `flushed` has set the flush (this process)


def _loaded_libgomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's own, or the system's it links)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line and line.split()[-1].startswith("/")}
    return min(paths) if paths else None


def set_everywhere(on: bool) -> str:
    """Flush (on) or keep subnormals on the calling thread and every thread of the OpenMP pool.
    -> "all threads", "main thread" (no libgomp found) or "unsupported" (this CPU cannot flush)."""
    if not torch.set_flush_denormal(on):
        return "unsupported"
    _flushing[0] = on
    path = _loaded_libgomp()
    if path is None:
        return "main thread"
    gomp = ctypes.CDLL(path)
    set_here = _CALLBACK(lambda _: torch.set_flush_denormal(on))  # kept alive for the call
    gomp.GOMP_parallel(set_here, None, ctypes.c_uint(torch.get_num_threads()), ctypes.c_uint(0))
    return "all threads"


@contextmanager
def flushed(enabled: bool):
    """Subnormals flushed for the block (`enabled`), then back to IEEE subnormals; yields where it applied
    ("all threads", "main thread", "unsupported", or "off")."""
    if not enabled:
        yield "off"
        return
    applied = set_everywhere(True)
    try:
        yield applied
    finally:
        if applied != "unsupported":
            set_everywhere(False)


@contextmanager
def kept():
    """IEEE subnormals for the block inside `flushed` (the target's own forward, which must give the bits
    precompute gives: online features), flushed again after; nothing to do outside it."""
    if not _flushing[0]:
        yield
        return
    set_everywhere(False)
    try:
        yield
    finally:
        set_everywhere(True)
