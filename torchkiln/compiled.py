"""Calls of a compiled function that skip dynamo's guard evaluation where the caller keys its
compiled functions by everything the guards would check.

torch.compile evaluates its guards on every call: for a decoder step, one check per weight,
cache and module attribute the step reads (~5,000 guard nodes for a 24-layer llama). On a 2-core
Zen 3 that was 0.45-0.9 ms of a 19 ms llama-350m int8 decode step (benchmarks/RESULTS.md,
twentieth session). The LLM runner compiles one step per (input width, batch, cache length) and
builds a new runner when the weights move (``.to()``, a copy), so past the first call those
guards can only pass. ``Unguarded`` then calls under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (torch >= 2.6), and calls the guarded
way whenever something a guard checks could differ from the first call: the inputs' shapes,
strides, dtypes or devices, torch's global state (grad mode, thread count, autocast, inference
mode, active torch-function or dispatch modes), a stance of the user's, or a call from inside
another compiled region. A guarded call that recompiles adds a cache entry; with several,
dynamo still evaluates the guards that tell them apart.
"""

from __future__ import annotations

import torch


def _signature(args: tuple) -> tuple:
    return tuple((a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
                 for a in args)


def _modes(device_type: str) -> tuple:
    """What dynamo guards on that torch's GlobalStateGuard leaves out on some versions (2.6's
    does not read autocast)."""
    return (torch.is_inference_mode_enabled(), torch._C._len_torch_function_stack(),
            torch._C._len_torch_dispatch_stack(), torch.is_autocast_enabled(device_type),
            torch.is_autocast_enabled("cpu"))


def _default_stance() -> bool:
    from torch._dynamo import eval_frame

    stance = getattr(eval_frame, "_stance", None)
    return (stance is not None and stance.stance == "default" and not stance.skip_guard_eval_unsafe
            and stance.backend is None)


class Unguarded:
    """``fn`` (a torch.compile'd function, called with positional arguments), its guards
    evaluated on the first call and skipped on later calls like it (module docstring)."""

    def __init__(self, fn, device_type: str):
        self.fn, self.device_type = fn, device_type
        self.signature = self.state = self.modes = None

    def same(self, args: tuple) -> bool:
        """A call like the first: the only kind whose guards are skipped."""
        return (self.signature is not None and _signature(args) == self.signature and self.state.check()
                and _modes(self.device_type) == self.modes and _default_stance()
                and not torch.compiler.is_compiling())

    def __call__(self, *args):
        if self.same(args):
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.fn(*args)
        out = self.fn(*args)
        if self.signature is None:
            from torch._C._dynamo.guards import GlobalStateGuard

            self.signature, self.modes = _signature(args), _modes(self.device_type)
            self.state = GlobalStateGuard()  # reads the state now; check() compares with it
        return out
