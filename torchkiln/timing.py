"""The timing loops behind every measured decision: a host-clock median for
plan-time CPU micro-measurements, and interleaved rounds (with device
synchronisation) for choosing among whole-model candidates."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, budget_s: float,
                min_rounds: int = 3, max_rounds: int = 50, prune: float = 1.5,
                errors: dict[str, BaseException] | None = None, min_samples: int = 10) -> dict[str, list[float]]:
    """Seconds per call of each function, timed in rounds (one call of each per round)
    so drift on a noisy machine hits all alike. Runs at least ``min_rounds``, then
    until ``budget_s`` is spent; after ``min_rounds``, functions slower than
    ``prune`` x the best median in every call stop being timed (their times so far are kept).
    The functions still timed then get up to ``min_samples`` calls each, in at most
    twice the budget: slow candidates (eager, 15x slower) used to spend the budget in
    the first rounds, leaving the close contenders 3 calls each, and one stall flipped
    the choice (bert-base int8 on a noisy 2-core VM: the 21-ms graph timed above the
    24-ms one; RESULTS.md).
    A function that raises is dropped (no times) and its exception put in ``errors``."""
    times: dict[str, list[float]] = {n: [] for n in fns}
    live = list(fns)
    start = time.perf_counter()
    for r in range(max_rounds):
        spent = time.perf_counter() - start
        if r >= min_rounds and spent > budget_s and (
                spent > 2 * budget_s or min(len(times[n]) for n in live) >= min_samples):
            break
        for n in list(live):
            synchronize(device)
            t = time.perf_counter()
            try:
                fns[n]()
                synchronize(device)
            except Exception as e:
                if errors is None:
                    raise
                errors[n] = e
                live.remove(n)
                del times[n]
                continue
            times[n].append(time.perf_counter() - t)
        if not live:
            break
        if r + 1 >= min_rounds and len(live) > 1:
            # Pruned by its fastest call, not its median: after a slow model's calls the next few of the
            # fastest one can all run slow (bert-base int8 bs1 on a 2-core Zen 5: the 20.6-ms compiled
            # graph timed 38.7 ms over its first 3 calls behind the 300-ms eager ones, was pruned at 1.5x
            # and a 21-ms stock graph served; RESULTS.md). A candidate that is really slower has no fast call.
            best = min(statistics.median(times[n]) for n in live)
            live = [n for n in live if min(times[n]) <= prune * best]
    return times
