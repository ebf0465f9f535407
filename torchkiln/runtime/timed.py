"""`tk.runtime.measure(fn, items=...)`: time a workload the way `torchkiln run --autotune` compares layouts.

A benchmark script calls it once with its steady-state step. Run alone it warms up, times calls for a
few seconds and returns throughput and latency. Under `--autotune` (the launcher sets
$TORCHKILN_AUTOTUNE_DIR) it also:

- waits, after its warm-up, until every instance of the layout is warm (a file barrier). Instances warm
  up at different speeds (compiles, caches), and an instance timed while another still compiles would
  have the cores' bandwidth to itself and read fast;
- times for the same fixed window in every instance, so all of them run under the same contention from
  start to end. A fixed number of calls would let a fast instance finish early and the slow ones run
  the rest alone;
- writes its figures to the autotune folder for the launcher to add up.

Standard library only: the launcher imports this file's names without importing torch.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["measure"]

DIR_ENV = "TORCHKILN_AUTOTUNE_DIR"
SECONDS_ENV = "TORCHKILN_AUTOTUNE_SECONDS"
BARRIER_TIMEOUT_S = 900.0  # the slowest instance's warm-up (a cold inductor compile on one core)


def _wait_for_all(folder: Path, index: int, count: int) -> None:
    (folder / f"ready_{index}").touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while sum(1 for i in range(count) if (folder / f"ready_{i}").exists()) < count:
        if (folder / "abort").exists():
            raise RuntimeError("torchkiln autotune: another instance of this layout failed; stopping")
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchkiln autotune: the other instances were not warm after "
                               f"{BARRIER_TIMEOUT_S:.0f} s")
        time.sleep(0.01)


def measure(fn: Callable[[], object], items: int = 1, seconds: float | None = None, warmup: int = 3,
            sync: Callable[[], object] | None = None) -> dict:
    """Call `fn()` `warmup` times, then as often as fits in `seconds` (default 3, or what the autotuner
    asks for). `items` is the work of one call (the batch size), so throughput is items per second.
    `sync` runs after each call when the work is asynchronous (`torch.cuda.synchronize`).

    Returns {"items", "calls", "seconds", "items_per_s", "latency_ms", "started"}: latency is the median
    call, `started` the wall-clock time the timed window began."""
    if isinstance(items, bool) or not isinstance(items, int) or items < 1:
        raise ValueError(f"items={items!r}: the number of samples one call processes, a positive integer")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: a number of calls, 0 or more")
    folder = os.environ.get(DIR_ENV)
    window = float(os.environ.get(SECONDS_ENV, 3.0)) if seconds is None else float(seconds)
    if not window > 0:
        raise ValueError(f"seconds={seconds!r}: a positive number of seconds to time for")
    index = int(os.environ.get("TORCHKILN_INSTANCE", "0"))
    count = int(os.environ.get("TORCHKILN_INSTANCES", "1"))
    try:
        for _ in range(warmup):
            fn()
            if sync:
                sync()
        if folder:
            _wait_for_all(Path(folder), index, count)
        times = []
        started = time.time()  # wall clock, comparable across instances (diagnostics, tests)
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            t1 = time.perf_counter()
            times.append(t1 - t0)
            if t1 - start >= window:
                break
    except BaseException:
        if folder:  # release the others from the barrier instead of leaving them waiting
            (Path(folder) / "abort").touch()
        raise
    elapsed = time.perf_counter() - start
    result = {"items": items * len(times), "calls": len(times), "seconds": elapsed,
              "items_per_s": items * len(times) / elapsed, "latency_ms": statistics.median(times) * 1e3, "started": started}
    if folder:
        tmp = Path(folder) / f".report_{index}.json"
        tmp.write_text(json.dumps(result))
        tmp.replace(Path(folder) / f"report_{index}.json")
    return result
