"""What the benchmarks share (they run as scripts from this folder, so `from timing import`): the timing helper,
and how a result records its machine and command."""

from __future__ import annotations

import os
import platform
import statistics
import time

from mtp_train.config import PLAIN_HEAD  # noqa: F401  (re-exported: the benchmarks import it from here)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine(threads: int, load=None) -> dict:
    """The machine a result was measured on; `load` defaults to the 1-minute load average now."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": threads,
            "load_average_1min": os.getloadavg()[0] if load is None else load}


def command(script: str, args) -> str:
    """The command line that reproduces a run: `script` with every argparse option that is set."""
    return f"benchmarks/{script} " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if v is not None)
