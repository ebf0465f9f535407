"""Serving a CPU model through TorchScript with PyTorch's oneDNN Graph fuser (LLGA).

A serving backend beside compile.py, not a module rewrite: optimize() times it as one
more candidate and serves it only where it is fastest and passes the guard.

Why it exists: on CPU conv nets, inductor with freezing calls every oneDNN convolution
through its own op (ideep rebuilds descriptors and looks up the primitive per call, with
Python between ops); oneDNN Graph compiles fused partitions (conv + bias + add + relu)
once per shape and runs them from C++. Measured on a 2-core Zen 3, resnet50 fp32,
interleaved in one process: bs1 inductor 71.0 ms, this 61.9 ms (1.16x); bs8 1.04x; IPEX
2.8 does the same kind of fusion (RESULTS.md, "Against IPEX 2.8"). This is the part of
IPEX's recipe that stock PyTorch still ships, so it is used rather than hand-written.

Three rules keep it safe:
- One trace per input signature (shapes, dtypes, the non-tensor arguments), up to
  MAX_SIGNATURES; a trace never runs at a shape it was not traced at. Beyond that, and for
  a later signature that cannot be traced, the eager model runs.
- A trace that turned a tensor into a Python value (TracerWarning) has baked a
  data-dependent branch (transformers' mask checks do this): refused, with the reason.
- The fuser switch is process-wide in TorchScript, so it is on only while our own trace
  is optimised (its first calls, under a lock) and restored after; the optimised plan
  stays cached for that signature.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
from torch import nn
from torch.utils import _pytree as pytree

MAX_SIGNATURES = 4
_LOCK = threading.Lock()
_UNSAFE = "Converting a tensor to a Python"


class Unsupported(RuntimeError):
    """This model or input cannot be served through a trace; the message says why."""


def available() -> bool:
    c = torch._C
    return (hasattr(c, "_jit_set_llga_enabled") and hasattr(c, "_jit_llga_enabled")
            and torch.backends.mkldnn.is_available())


def signature(args, kwargs) -> tuple:
    return _key(*pytree.tree_flatten((args, kwargs)))


def _key(leaves, spec) -> tuple:
    return (str(spec), tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor)
                             else ("value", repr(t)) for t in leaves))


_EAGER = object()  # a signature the eager model serves


def tensor_leaves(args, kwargs) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]


class _Bound(nn.Module):
    """``model`` called with the tensors of one call's inputs only, every other input (a float, a
    flag, a string, None) bound to the value it had. torch.jit.trace takes tensors alone: a float
    given positionally failed the trace and stepped the candidate down for every later call (the
    twenty-ninth session's probes), and a trace would bake such values in anyway: signature() keys
    one trace per value."""

    def __init__(self, model: nn.Module, args, kwargs):
        super().__init__()
        self.model = model
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.fixed = [None if isinstance(v, torch.Tensor) else v for v in leaves]

    def forward(self, *tensors):
        leaves = list(self.fixed)
        for i, t in zip(self.slots, tensors, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.model(*args, **kwargs)


def _plain(out) -> bool:
    # jit.trace returns tensors and tuples of tensors unchanged; other containers
    # (HF ModelOutput, dicts, lists) would come back as a different type.
    if isinstance(out, torch.Tensor):
        return True
    return type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out)


class PerSignature:
    """Calls ``model`` through one trace per input signature, made by ``_trace`` (a subclass's), up to
    ``max_signatures``; past that the model itself runs. ``_scope`` wraps each traced call."""

    def __init__(self, model: nn.Module, max_signatures: int = MAX_SIGNATURES):
        self.model, self.max_signatures = model, max_signatures
        self.traces: dict[tuple, torch.jit.ScriptModule] = {}

    def _trace(self, args, kwargs) -> torch.jit.ScriptModule:
        raise NotImplementedError

    def _scope(self):
        return contextlib.nullcontext()

    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))  # once: the key and the trace's inputs
        key = _key(leaves, spec)
        fn = self.traces.get(key)
        if fn is None:
            with _LOCK:
                fn = self.traces.get(key)
                if fn is None and len(self.traces) < self.max_signatures:
                    try:
                        fn = self.traces[key] = self._trace(args, kwargs)
                    except Unsupported:
                        if not self.traces:
                            raise  # the first signature: this candidate cannot serve the model at all
                        # A later one (another flag, an output form a trace would change): eager for it,
                        # where it used to step the whole candidate down for every later call.
                        fn = self.traces[key] = _EAGER
        if fn is None or fn is _EAGER:  # past the cap: eager, outside the lock so calls stay concurrent
            return self.model(*args, **kwargs)
        with torch.no_grad(), self._scope():
            return fn(*[v for v in leaves if isinstance(v, torch.Tensor)])


class OneDNNGraph(PerSignature):
    """Calls ``model`` through one frozen, oneDNN-Graph-fused TorchScript trace per input signature."""

    def __init__(self, model: nn.Module, max_signatures: int = MAX_SIGNATURES):
        if not available():
            raise Unsupported("this torch build has no oneDNN Graph fuser")
        super().__init__(model, max_signatures)

    def _trace(self, args, kwargs) -> torch.jit.ScriptModule:
        frozen = frozen_trace(self.model, args, kwargs)
        runs = torch._C._jit_get_num_profiled_runs() + 2  # profile, then optimise with the fuser on
        prev = torch._C._jit_llga_enabled()
        torch._C._jit_set_llga_enabled(True)
        flat = tensor_leaves(args, kwargs)
        try:
            with torch.no_grad():
                for _ in range(runs):
                    frozen(*flat)
        finally:
            torch._C._jit_set_llga_enabled(prev)
        return frozen


def frozen_trace(model: nn.Module, args, kwargs, branches_checked: bool = False) -> torch.jit.ScriptModule:
    """``model`` traced at these inputs and frozen, called with their tensors only (tensor_leaves, in
    order; the other inputs are bound: _Bound); refused (Unsupported) where a trace would not serve it
    faithfully. ``branches_checked``: the model is known to hold no data-dependent branch (an exported
    graph), so a tensor read as a Python value (export's shape guards) is no refusal."""
    flat = tensor_leaves(args, kwargs)
    if not flat:
        raise Unsupported("no tensor among the inputs")
    with torch.no_grad():
        if not _plain(model(*args, **kwargs)):
            raise Unsupported("outputs are not a tensor or a tuple of tensors (a trace would change their type)")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            traced = torch.jit.trace(_Bound(model, args, kwargs), tuple(flat), check_trace=False)
        bad = [w for w in seen if issubclass(w.category, torch.jit.TracerWarning) and _UNSAFE in str(w.message)]
        if bad and not branches_checked:
            w = bad[0]
            raise Unsupported(f"the trace turned a tensor into a Python value at {w.filename}:{w.lineno}, "
                              "so it would bake in one branch of data-dependent code")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.freeze(traced.eval())
