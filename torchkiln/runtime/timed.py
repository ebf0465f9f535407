"""`tk.runtime.measure(fn, items=...)`: time a workload the way `torchkiln run --autotune` compares layouts.

A benchmark script calls it once with its steady-state step. Run alone it warms up, times calls for a
few seconds and returns throughput and latency. Under `--autotune` (the launcher sets
$TORCHKILN_AUTOTUNE_DIR) the instance stays up for the whole tuning run instead:

- after its warm-up it marks itself ready and waits. The tuner starts every layout's instances once,
  so each instance warms up (compiles, runs tk.optimize) once, not once per round;
- it times one window each time the tuner says `go_R` (a file), which the tuner does for one layout
  at a time, after every instance of every layout is warm: an instance timed while another still
  compiles, or while another layout runs, would read the wrong machine;
- every instance of the layout times the same fixed window, so all run under the same contention from
  start to end (a fixed number of calls would let a fast instance finish early and the rest run alone);
- it writes each window's figures for the tuner, and returns when the tuner says `stop`.

Waiting is a 20 ms poll of the folder: the go signals reach the instances within 20 ms of each other
(under 1% of a 3 s window), and a waiting instance costs ~50 wake-ups a second.

Standard library only: the launcher imports this file's names without importing torch.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["measure"]

DIR_ENV = "TORCHKILN_AUTOTUNE_DIR"
SECONDS_ENV = "TORCHKILN_AUTOTUNE_SECONDS"
WAIT_S = 3600.0  # for the other layouts' warm-up (cold inductor compiles, several processes at once)
POLL_S = 0.02


def _wait_for(folder: Path, names: tuple[str, ...]) -> str:
    """The first of `names` to appear in `folder`."""
    deadline = time.monotonic() + WAIT_S
    while True:
        for name in names:
            if (folder / name).exists():
                return name
        if (folder / "abort").exists():
            raise RuntimeError("torchkiln autotune: the tuning run was stopped (an instance failed, or the "
                               "tuner ended); stopping")
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchkiln autotune: no word from the tuner for {WAIT_S:.0f} s")
        time.sleep(POLL_S)


def _window(fn, sync, items: int, window: float) -> dict:
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
    elapsed = time.perf_counter() - start
    return {"items": items * len(times), "calls": len(times), "seconds": elapsed,
            "items_per_s": items * len(times) / elapsed, "latency_ms": statistics.median(times) * 1e3,
            "started": started}


def _write(folder: Path, name: str, result: dict) -> None:
    tmp = folder / f".{name}"
    tmp.write_text(json.dumps(result))
    tmp.replace(folder / name)  # the tuner never reads half a report


def measure(fn: Callable[[], object], items: int = 1, seconds: float | None = None, warmup: int = 3,
            sync: Callable[[], object] | None = None) -> dict:
    """Call `fn()` `warmup` times, then as often as fits in `seconds` (default 3, or what the autotuner
    asks for). `items` is the work of one call (the batch size), so throughput is items per second.
    `sync` runs after each call when the work is asynchronous (`torch.cuda.synchronize`).

    Returns {"items", "calls", "seconds", "items_per_s", "latency_ms", "started"}: latency is the median
    call, `started` the wall-clock time the timed window began. Under --autotune: the last window's
    figures, after the tuner's `stop` ({} if it timed none here)."""
    if isinstance(items, bool) or not isinstance(items, int) or items < 1:
        raise ValueError(f"items={items!r}: the number of samples one call processes, a positive integer")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: a number of calls, 0 or more")
    folder = os.environ.get(DIR_ENV)
    window = float(os.environ.get(SECONDS_ENV, 3.0)) if seconds is None else float(seconds)
    if not window > 0:
        raise ValueError(f"seconds={seconds!r}: a positive number of seconds to time for")
    try:
        for _ in range(warmup):
            fn()
            if sync:
                sync()
        if not folder:
            return _window(fn, sync, items, window)
        folder, index = Path(folder), int(os.environ.get("TORCHKILN_INSTANCE", "0"))
        _write(folder, f"ready_{index}", {})
        result: dict = {}
        for r in itertools.count():
            if _wait_for(folder, (f"go_{r}", "stop")) == "stop":
                return result
            result = _window(fn, sync, items, window)
            _write(folder, f"report_{r}_{index}.json", result)
    except BaseException:
        if folder:  # release this layout's other instances instead of leaving them waiting
            (Path(folder) / "abort").touch()
        raise
