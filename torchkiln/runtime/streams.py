"""`tk.runtime.MultiStreamModule` and `tk.runtime.Task`: model calls on threads of their own,
each pinned to its own cores with its own OpenMP team (pool.py says how that is obtained).

On a many-core CPU one model call rarely keeps every core busy (OpenMP barriers per op, small
GEMMs): several streams, each on a slice of the cores with its part of the batch, trade that
synchronisation for parallel independent work. Whether it pays is measured, not assumed
(benchmarks/runtime_streams.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading

import torch
from torch import nn

from .. import inputs
from .pool import CPUPool


class _Worker:
    """A daemon thread bound to ``pool`` before its first torch op, so its OpenMP team is made
    there with ``len(pool.core_ids)`` threads; runs submitted calls in order."""

    def __init__(self, pool: CPUPool):
        self.pool = pool
        self._q: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kiln-stream-{pool.core_ids}")
        self._thread.start()
        self._ready.wait()

    def _run(self):
        os.sched_setaffinity(0, set(self.pool.core_ids))
        # torch initialises a thread's OpenMP thread count from the process default at its first
        # op (which another stream, or the caller, may change meanwhile): trigger that first,
        # then set this thread's own count, which later ops keep.
        torch.get_num_threads()
        torch.set_num_threads(len(self.pool.core_ids))
        self._ready.set()
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args, kwargs, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # handed to the caller through the future
                    fut.set_exception(e)

    def submit(self, fn, *args, **kwargs) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._q.put((fn, args, kwargs, fut))
        return fut

    def close(self):
        self._q.put(None)


def _workers(pools: list[CPUPool]) -> list[_Worker]:
    # Worker threads set torch's thread count, which is also the process default: give the
    # caller's back (its own OpenMP team is unaffected either way).
    n = torch.get_num_threads()
    out = [_Worker(p) for p in pools]
    torch.set_num_threads(n)
    return out


class Task:
    """``Task(model, pool)(x)`` returns a ``concurrent.futures.Future`` of ``model(x)`` run on
    ``pool``'s cores; ``.result()`` (or IPEX's ``.get()``) waits for it."""

    def __init__(self, model, pool: CPUPool):
        self.model = model
        self._worker = _workers([pool])[0]

    def __call__(self, *args, **kwargs) -> cf.Future:
        fut = self._worker.submit(self.model, *args, **kwargs)
        fut.get = fut.result  # the name ipex.cpu.runtime.Task's futures have
        return fut

    def __del__(self):
        if hasattr(self, "_worker"):
            self._worker.close()


class MultiStreamModule(nn.Module):
    """Splits the batch (dim 0 of every tensor argument of the first one's batch size) into
    ``num_streams`` parts, runs ``model`` on each in its own pinned stream, and joins the
    outputs along dim 0 (``concat_output=False``: the list of per-stream outputs).
    ``num_streams="auto"``: one per physical core of ``pool`` (default: every core here)."""

    def __init__(self, model, num_streams="auto", pool: CPUPool | None = None, concat_output: bool = True):
        super().__init__()
        pool = pool or CPUPool()
        n = len(pool.core_ids) if num_streams == "auto" else num_streams
        if not isinstance(n, int) or not 1 <= n <= len(pool.core_ids):
            raise ValueError(f"num_streams={num_streams!r}: use 'auto' or 1..{len(pool.core_ids)} (the pool's "
                             f"cores: {list(pool.core_ids)})")
        self.model = model
        self.num_streams, self.concat_output = n, concat_output
        object.__setattr__(self, "_streams", _workers(pool.split(n)))
        object.__setattr__(self, "_warm", False)

    def forward(self, *args, **kwargs):
        batch = inputs.batch_size((args, kwargs))
        if batch is None:
            raise ValueError("MultiStreamModule needs a tensor argument with a batch dimension to split")
        parts = min(self.num_streams, batch)
        chunks = [_chunk((args, kwargs), batch, parts, i) for i in range(parts)]
        if not self._warm:
            # The first call compiles or plans in many models (tk.optimize does): once, alone.
            first = self._streams[0].submit(self.model, *chunks[0][0], **chunks[0][1]).result()
            object.__setattr__(self, "_warm", True)
            rest = [s.submit(self.model, *a, **k) for s, (a, k) in zip(self._streams[1:], chunks[1:], strict=False)]
            outs = [first] + [f.result() for f in rest]
        else:
            futs = [s.submit(self.model, *a, **k) for s, (a, k) in zip(self._streams, chunks, strict=False)]
            outs = [f.result() for f in futs]
        return _concat(outs) if self.concat_output else outs

    def __del__(self):
        for s in getattr(self, "_streams", ()):
            s.close()  # the stream threads end; they would otherwise live as long as the process


def _chunk(args: inputs.Args, batch: int, parts: int, i: int) -> inputs.Args:
    size, extra = divmod(batch, parts)
    start = i * size + min(i, extra)
    end = start + size + (i < extra)
    return inputs.tree_map(lambda t: t[start:end] if t.dim() > 0 and t.shape[0] == batch else t, args)


def _concat(outs: list):
    import torch.utils._pytree as pytree

    leaves, spec = zip(*(pytree.tree_flatten(o) for o in outs), strict=True)
    joined = [torch.cat(ts) if isinstance(ts[0], torch.Tensor) and ts[0].dim() > 0 else ts[0]
              for ts in zip(*leaves, strict=True)]
    return pytree.tree_unflatten(joined, spec[0])
