"""Can inductor's config options be applied only while dynamo compiles, instead of around every call?

torchkiln's Compiled wraps every call in ``inductor_config.patch(options)`` (35 us a call on a 2-core
Zen 3; on torch < 2.13 the patch is also process-wide, so threads end each other's). Freezing is read
when dynamo traces (``is_parameter_freezing``), so the options must hold during the trace, not only in
the backend. This prototype enters the patch from dynamo's compile-start callback (and leaves it at
compile end) for the thread whose call is compiling, and compares: is the graph frozen (an in-place
weight change must not reach a frozen graph's output), and what each way costs per call.

Caveats before it can replace the per-call patch (benchmarks/RESULTS.md, fourteenth session):
torch._dynamo.reset() clears every registered callback; on torch >= 2.8 the start callbacks do not
run when another compile-time callback scope is open (CUDA-graph recording in another thread); the
callbacks take no argument on torch 2.6 and a CallbackArgs later.

    python benchmarks/diag_config_patch.py
"""

from __future__ import annotations

import statistics
import threading

import torch
import torch._inductor.config as inductor_config
from torch import nn

from torchkiln.timing import median_seconds

_local = threading.local()


def _start(*_):  # torch 2.6 calls it with nothing, later torch with a CallbackArgs
    opts = getattr(_local, "options", None)
    if opts is not None and getattr(_local, "entered", None) is None:
        patch = inductor_config.patch(opts)
        patch.__enter__()
        _local.entered = patch


def _end(*_):
    patch = getattr(_local, "entered", None)
    if patch is not None:
        _local.entered = None
        patch.__exit__(None, None, None)


class AtCompile(nn.Module):
    """The options set only while this thread's call compiles."""

    def __init__(self, model: nn.Module, options: dict):
        super().__init__()
        self.compiled, self.options = torch.compile(model), options

    def forward(self, x):
        prev, _local.options = getattr(_local, "options", None), self.options
        try:
            return self.compiled(x)
        finally:
            _local.options = prev
            if prev is None:
                _end()  # an end callback that ran elsewhere (another thread's scope) leaves ours open


class EveryCall(nn.Module):
    """torchkiln's Compiled: the options patched around every call."""

    def __init__(self, model: nn.Module, options: dict):
        super().__init__()
        self.compiled, self.options = torch.compile(model), options

    def forward(self, x):
        with inductor_config.patch(self.options):
            return self.compiled(x)


def frozen(wrapper) -> bool:
    lin, x = nn.Linear(8, 8).eval(), torch.randn(2, 8)
    w = wrapper(lin, {"freezing": True})
    with torch.no_grad():
        before = w(x)
        lin.weight.mul_(2)
        return torch.equal(before, w(x))


def per_call_us(f, n: int = 3000) -> float:
    return median_seconds(f, warmup=100, iters=n) * 1e6


def main() -> None:
    handler = torch._dynamo.callback.callback_handler
    handler.register_start_callback(_start)
    handler.register_end_callback(_end)
    print(f"torch {torch.__version__}: frozen at compile only: {frozen(AtCompile)}, every call: {frozen(EveryCall)}, "
          f"plain compile (control): {frozen(lambda m, o: torch.compile(m))}; freezing after: {inductor_config.freezing}")
    torch.set_num_threads(1)
    lin, x = nn.Linear(8, 8).eval(), torch.randn(2, 8)
    from torchkiln.passes.compile import Compiled

    ways = {"options at compile only": AtCompile(lin, {"freezing": True}),
            "options patched every call": EveryCall(lin, {"freezing": True}),
            "torchkiln's Compiled": Compiled(lin, {"freezing": True})}
    with torch.no_grad():
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(5):
            for k, w in ways.items():
                times[k].append(per_call_us(lambda w=w: w(x)))
    for k, ts in times.items():
        print(f"{k:<28} {statistics.median(ts):7.1f} us a call (median of 5 rounds)")


if __name__ == "__main__":
    main()
