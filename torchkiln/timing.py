"""The timing loops behind every measured decision: a host-clock median for
plan-time CPU micro-measurements, interleaved rounds (with device
synchronisation) for choosing among whole-model candidates, and interleaved
blocks of calls for the served form against the model as given at a new shape."""

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


SHORT_CALL = 0.005  # s: interleaved(streams=True) times functions whose calls all take less in blocks


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, budget_s: float,
                min_rounds: int = 3, max_rounds: int = 50, prune: float = 1.5,
                errors: dict[str, BaseException] | None = None, min_samples: int = 10,
                streams: bool = False) -> dict[str, list[float]]:
    """Seconds per call of each function, timed in rounds (one call of each per round)
    so drift on a noisy machine hits all alike. Runs at least ``min_rounds``, then
    until ``budget_s`` is spent; after ``min_rounds``, functions slower than
    ``prune`` x the best median in every call stop being timed (their times so far are kept).
    The functions still timed then get up to ``min_samples`` calls each, in at most
    twice the budget: slow candidates (eager, 15x slower) used to spend the budget in
    the first rounds, leaving the close contenders 3 calls each, and one stall flipped
    the choice (bert-base int8 on a noisy 2-core VM: the 21-ms graph timed above the
    24-ms one; RESULTS.md).
    A function that raises is dropped (no times) and its exception put in ``errors``.

    ``streams``: on the CPU, functions whose calls all take less than ``SHORT_CALL`` are timed in
    blocks instead (``blocks``, about 30 ms each). One call of each in turn pays a switch from the other
    form at every call, 0.5-1.2 ms on a 2-core Zen 4: an MLP at one row read its model as given at
    0.61-0.97 ms a call where a stream ran 0.36, and the eager passes served there ran 1.18x (float32)
    and 1.35x (bf16) slower than it (thirty-fifth session). Only for functions that can be called
    again freely (blocks make more calls): not a training step."""
    if streams and device.type == "cpu":
        got = _streams(fns, device, budget_s)
        if got is not None:
            return got
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


def _streams(fns: dict, device: torch.device, budget_s: float) -> dict[str, list[float]] | None:
    """``blocks`` for short calls (interleaved's ``streams``); None where a call is long or one fails (the
    rounds then time them, and drop the failing one)."""
    try:
        if not fns or max(_one_call(f, device) for f in fns.values()) >= SHORT_CALL:
            return None
        return blocks(fns, device, budget_s, block_s=0.03)
    except Exception:
        return None


def _one_call(call, device: torch.device) -> float:
    synchronize(device)
    t = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - t


def blocks(calls: dict, device: torch.device, budget: float, rounds: int = 5,
           block_s: float = 0.01) -> dict[str, list[float]]:
    """Seconds per call of each function, timed in blocks of consecutive calls (about ``block_s`` a block),
    blocks interleaved over ``rounds`` after one untimed block each; on the CPU each call of a block is
    a sample of its own (elsewhere, each block's mean: the calls queue).

    Why so (an MLP at one row on a 2-core Zen 4, whose steady streams ran 0.36 ms a call as given and
    0.49 served; RESULTS.md, thirty-third and thirty-fifth sessions; KilnModule._slower_than_given):
    - Not one call of each in turn, as the selection's ``interleaved`` times: every call then paid a
      switch from the other form (the model as given read 1.18 ms a call where it ran 0.66 in a stream).
    - A block's first calls still pay that switch, 0.5-1.2 ms over the steady time (the first call 2-3x,
      the next 1.3-1.9x), the model as given more than the served form. Block means carried it, and read
      a 1.33x slowdown as 0.96-1.23x; the median of single calls leaves those few out.
    - Blocks are sized by a warm call: the model as given's cold first call (1.1 ms) halved its blocks.
      A block's calls beyond its switch are the samples that count."""
    per = {}
    for name, call in calls.items():
        per[name] = _one_call(call, device)
        for _ in range(2):  # a block of several: sized by a warm call (the third, if the first two were slow)
            if per[name] < block_s:
                per[name] = min(per[name], _one_call(call, device))
    n = {name: max(1, min(50, int(block_s / max(s, 1e-6)))) for name, s in per.items()}
    rounds = max(2, min(rounds, int(budget / max(sum(n[k] * per[k] for k in calls), 1e-6))))
    each = device.type == "cpu"
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds + 1):  # the first round warms each up in a block of its own, untimed
        for name, call in calls.items():
            if each:
                got = [_one_call(call, device) for _ in range(n[name])]
                if r:
                    times[name] += got
                continue
            synchronize(device)
            t = time.perf_counter()
            for _ in range(n[name]):
                call()
            synchronize(device)
            if r:
                times[name].append((time.perf_counter() - t) / n[name])
    return times
