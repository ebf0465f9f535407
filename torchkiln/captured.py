"""One CUDA graph per input signature, captured by hand around a compiled model.

Why not inductor's CUDA-graph trees (``mode="reduce-overhead"``, torchkiln's other graph candidate):
each call through them pays dynamo's frame and guard evaluation and the trees' bookkeeping on the
host, ~0.19 ms of bert-base's 0.64-ms bf16 bs1 call on the H200 before the replay was queued
(``benchmarks/diag_bs1_host.py``, thirty-sixth session), and the tk.bench latency loop (and any
caller that waits for its answer) pays it at every batch size. Here a call at a captured signature
copies its tensors into the graph's static inputs and replays: no Python of the model's or
dynamo's. What that skips is the reason it may only wrap a private compiled model whose guards
cannot change between calls: torchkiln's own (weights frozen in, mode flags fixed by the
caller's ``_serve``), and only for calls of tensors and plain values (a cache object or a list of
tensors would be baked into the graph), all on the graph's device.

Outputs are copied out of the graph's pool before the call returns, on the stream that replayed,
and the next call's stream waits for those copies (an event), so calls from several threads or
streams never read an output a later replay overwrote.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from ._log import warn_once
from .inputs import clone, flatten, signature
from .modelutil import PLAIN, first_line, is_oom

_NONE = object()
MAX_GRAPHS = 4  # signatures captured; later ones run the compiled model without a graph


@contextlib.contextmanager
def captured(g: torch.cuda.CUDAGraph, pool=None):
    """``torch.cuda.graph(g)`` with cuBLAS's workspaces dropped before and after, as torch's own
    CUDA-graph trees do (``clear_cublas_manager``). Why: cuBLAS keeps one workspace per stream and a
    graph bakes its address in. Dropped first, the capture allocates it in the graph's own pool
    (else it bakes in a block an eager call made, which a compiled model's CUDA-graph trees free
    when they record); dropped after, no later call or capture on the shared capture stream reuses
    a workspace that dies with this graph (writes into freed memory: an illegal address on the H200)."""
    from torch._inductor.cudagraph_trees import clear_cublas_manager

    with clear_cublas_manager(), torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        yield


class _Graph:
    __slots__ = ("graph", "args", "kwargs", "out")

    def __init__(self, graph, args, kwargs, out):
        self.graph, self.args, self.kwargs, self.out = graph, args, kwargs, out


class Captured:
    """Calls ``fn`` (a compiled model on ``device``) through CUDA graphs captured per input signature."""

    def __init__(self, fn: Callable, device: torch.device):
        self.fn, self.device = fn, device
        self._graphs: dict[tuple, _Graph | None] = {}  # None: not capturable, run ``fn``
        self._lock = threading.Lock()
        self._pool = None
        self._done: torch.cuda.Event | None = None  # after the last call's output copies
        self.notes: list[str] = []  # why a signature runs without a graph

    def holds_graph(self) -> bool:
        """A graph was captured (for some signature)."""
        return any(g is not None for g in self._graphs.values())

    def __call__(self, *args, **kwargs):
        sig = signature(args, kwargs)
        entry = self._graphs.get(sig)
        if entry is None:
            if sig in self._graphs or len(self._graphs) >= MAX_GRAPHS:
                return self.fn(*args, **kwargs)
            entry, answer = self._capture(sig, args, kwargs)
            if entry is None:
                return answer if answer is not _NONE else self.fn(*args, **kwargs)
        with self._lock:
            stream = torch.cuda.current_stream(self.device)
            if self._done is not None:
                stream.wait_event(self._done)  # the last replay's outputs are copied before this one runs
            for static, t in zip(entry.args, args, strict=True):
                if static is not None:
                    static.copy_(t, non_blocking=True)
            for k, static in entry.kwargs.items():
                static.copy_(kwargs[k], non_blocking=True)
            entry.graph.replay()
            out = clone(entry.out)
            self._done = stream.record_event(self._done)
        return out

    def _capture(self, sig, args, kwargs) -> tuple[_Graph | None, object]:
        """The first call at a signature: compiles (and Triton autotunes, cuBLAS sets up) outside any
        capture, then captures; the call answers from the graph, so what the guard verifies is a replay.
        Returns (the graph or None, the call's answer where it must not run again, else _NONE)."""
        why = self._uncapturable(args, kwargs)
        with self._lock:
            if sig in self._graphs:  # another thread's first call at it
                return self._graphs[sig], _NONE
            entry, answer = None, _NONE
            if why is None:
                try:
                    given = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                    before = [t.clone() for t in given]
                    out = self.fn(*args, **kwargs)
                    if any(not torch.equal(b, t) for b, t in zip(before, given, strict=True)):
                        # Replays would write into the static copies, not the caller's tensors (inductor's
                        # graph trees skip such models too); this call was the caller's one call.
                        why, answer = "the model writes into its inputs", out
                    else:
                        entry = self._record(args, kwargs)
                except Exception as e:  # noqa: BLE001 (the compiled model runs these calls without a graph)
                    if is_oom(e):
                        raise
                    why = f"capture failed: {type(e).__name__}: {first_line(e)}"
            if why is not None:
                self.notes.append(why)
                warn_once(f"captured:{id(self)}:{why}", f"torchkiln: no CUDA graph for these inputs ({why}); "
                          "they run the compiled model without one", owner=self)
            self._graphs[sig] = entry
        return entry, answer

    def _uncapturable(self, args, kwargs) -> str | None:
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor):
                if v.device != self.device:
                    return f"an input on {v.device}, not {self.device}"
                if v.requires_grad:
                    return "an input that requires grad"
            elif type(v) not in PLAIN:
                return f"a {type(v).__name__} argument (only tensors and plain values are copied in)"
        if torch.is_grad_enabled():
            return "grad mode is on"
        return None

    def _record(self, args, kwargs) -> _Graph:
        # Static inputs with the callers' strides: the compiled code was specialised on them.
        def static(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)

        s_args = [static(a) if isinstance(a, torch.Tensor) else a for a in args]
        s_kwargs = {k: static(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # a warm call on a side stream, as torch.cuda.graphs' docs ask
            self.fn(*s_args, **s_kwargs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with captured(g, self._pool):
            out = self.fn(*s_args, **s_kwargs)
        if any(t.device != self.device for t in flatten(out)):
            raise RuntimeError(f"an output not on {self.device}")
        return _Graph(g, [a if isinstance(a, torch.Tensor) else None for a in s_args],
                      {k: v for k, v in s_kwargs.items() if isinstance(v, torch.Tensor)}, out)
