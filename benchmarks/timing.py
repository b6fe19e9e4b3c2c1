"""The one timing helper the benchmarks share (they run as scripts from this folder, so `from timing import`)."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
