"""The one host-clock timing loop used by plan-time measurements (CPU work only;
bench.py adds device synchronisation for accelerators)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
