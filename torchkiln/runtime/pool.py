"""`tk.runtime.CPUPool` and `tk.runtime.pin`: run torch work on chosen cores, in-process.

How per-thread OpenMP teams and affinity are obtained with the stock libgomp that pip's torch
loads (no Intel OpenMP needed): on Linux, `sched_setaffinity(0, ...)` binds the *calling
thread*, and a thread created afterwards inherits its creator's mask. libgomp keeps one worker
team per thread that opens a parallel region, created at that thread's first region, and the
team size is the calling thread's `nthreads` ICV, which `torch.set_num_threads` sets. So a
thread that is pinned and sets its thread count before its first torch op gets a team of that
size on those cores: what `MultiStreamModule` and `Task` do, each on a thread of their own.
`pin()` on a thread that already has a team also re-binds that team's workers, found by their
/proc task ids: the native (non-Python) threads whose mask was the caller's; all restored after.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

from ..hardware.topology import detect_topology


@dataclass(frozen=True)
class CPUPool:
    """A set of logical CPUs. ``CPUPool()``: every physical core this process may use;
    ``CPUPool(node_id=1)``: the physical cores of NUMA node 1; ``CPUPool([0, 2])``: those CPUs."""

    core_ids: tuple[int, ...] = ()
    node_id: int | None = None

    def __init__(self, core_ids=None, node_id: int | None = None):
        topo = detect_topology()
        allowed = {c.cpu for c in topo.cpus}
        if core_ids is not None:
            ids = tuple(sorted({int(c) for c in core_ids}))
            bad = [c for c in ids if c not in allowed]
            if not ids or bad:
                raise ValueError(f"core_ids={list(core_ids)!r}: {bad or 'empty'} not usable by this process; "
                                 f"usable CPUs: {sorted(allowed)}")
        else:
            nodes = topo.nodes()
            if node_id is not None and node_id not in nodes:
                raise ValueError(f"node_id={node_id!r} does not exist here; NUMA nodes: {list(nodes)}")
            ids = tuple(c.cpu for c in topo.cpus if c.first_thread and (node_id is None or c.node == node_id))
        object.__setattr__(self, "core_ids", ids)
        object.__setattr__(self, "node_id", node_id)

    def split(self, n: int) -> list[CPUPool]:
        """``n`` disjoint pools of (nearly) equal size, in core order."""
        if not 1 <= n <= len(self.core_ids):
            raise ValueError(f"cannot split {len(self.core_ids)} cores into {n} pools; use 1..{len(self.core_ids)}")
        size, extra = divmod(len(self.core_ids), n)
        out, start = [], 0
        for i in range(n):
            end = start + size + (i < extra)
            out.append(CPUPool(self.core_ids[start:end]))
            start = end
        return out


def _tasks() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: no task ids to re-bind
        return set()


@contextlib.contextmanager
def pin(pool: CPUPool):
    """The calling thread, and the OpenMP team it runs torch ops with, on ``pool``'s cores with
    ``len(pool.core_ids)`` threads; both restored afterwards."""
    import torch

    before = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    cores = set(pool.core_ids)
    known = _tasks()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    # A team made before the pin keeps its workers' old masks; one warm-up region makes the team
    # the size asked, then every thread created since the process's main thread is re-bound.
    torch.ones(len(cores) * 4096).sum()
    python_threads = {t.native_id for t in threading.enumerate()}  # OpenMP workers are native threads
    workers = (_tasks() | known) - python_threads - {os.getpid()}
    rebound = []
    for tid in workers:
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(tid) == before:
                os.sched_setaffinity(tid, cores)
                rebound.append(tid)
    try:
        yield pool
    finally:
        os.sched_setaffinity(0, before)
        for tid in rebound:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before)
        torch.set_num_threads(threads)
