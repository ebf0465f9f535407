"""torchkiln's own recipe, built: the passes applied to a copy of the model, and
the runner that converts inputs and outputs around it."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from . import inputs
from ._log import warn_once
from .modelutil import DTYPES, copy_with, model_dtype
from .passes import registry
from .passes.registry import PassContext, Skip
from .passes.sdpa_math import SDPARouter
from .passes.tensors import remake
from .recipe import Recipe
from .report import Fallback

log = logging.getLogger(__name__)


class Runner(nn.Module):
    """The fast model plus the per-call input/output conversions, compiled as one
    graph so the casts and layout changes fuse with the first and last kernels."""

    def __init__(self, fast: nn.Module, recipe: Recipe, own_dtype: torch.dtype = torch.float32, upcast: bool = False):
        super().__init__()
        self.fast = fast
        # what the model as given outputs when no floating input says otherwise (token ids in): its
        # own precision. float32 was assumed, so an fp16 BERT served in fp16 answered in float32,
        # where eager answers in float16 (the thirty-first session's probes).
        self.own_dtype = own_dtype
        compute = DTYPES[recipe.dtype]
        self.compute = compute
        self.cast = recipe.dtype_mode == "cast" and compute != torch.float32
        self.autocast = recipe.dtype_mode == "autocast" and compute != torch.float32
        # a float32 copy of a half-precision model (build_fast's upcast): inputs go up to it, outputs
        # back down to the model's own precision
        self.upcast = upcast
        self.device = torch.device(recipe.device)
        self.channels_last = recipe.memory_format == "channels_last"
        self.router = SDPARouter(mode=recipe.attention) if recipe.attention != "sdpa" else None
        self.calibrated = self.router is None or recipe.attention == "opaque"

    def _convert_in(self, t: torch.Tensor) -> torch.Tensor:
        if t.device != self.device:
            t = t.to(self.device)
        if t.is_floating_point():
            if self.cast or self.upcast:
                t = t.to(self.compute)
            if self.channels_last and t.dim() in (4, 5):
                t = t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
        return t

    def calibrate(self, args, kwargs) -> str | None:
        """One eager call on real inputs, so the attention router can time its choices."""
        if self.calibrated:
            return None
        self.router.calibrating = True
        try:
            with torch.no_grad():
                self.forward(*args, **kwargs)
        finally:
            self.router.calibrating = False
            self.calibrated = True
        if not self.router.seen:
            # No attention in this model: the mode would only put every other op of an eager
            # candidate through a Python call. Dropping it: a DLRM-like model 0.913 -> 0.776 ms a
            # call, GRU/LSTM taggers 2.5% (benchmarks/RESULTS.md, twelfth session).
            self.router = None
            return None
        return self.router.summary() if self.router.timings else None

    def _call(self, args, kwargs):
        if self.autocast:
            with torch.autocast(self.device.type, dtype=self.compute):
                return self.fast(*args, **kwargs)
        return self.fast(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if not kwargs and all(type(a) is torch.Tensor for a in args) and not torch.compiler.is_compiling():
            # Positional plain tensors, run eagerly (an eager-passes candidate): the same conversions
            # without pytree's walks, which cost 18 of the 22 us this runner added to a call (an 8x8
            # Linear at one row: 7.8 us bare, 29.4 through the walks; 2-core Zen 4, RESULTS.md,
            # thirty-fourth session). Compiled candidates trace the walks, where they cost nothing.
            floats = [t.dtype for t in args if t.is_floating_point()]
            args = tuple(self._convert_in(t) for t in args)
        else:
            # no next(iterator, default): dynamo traces this forward, and torch 2.6's dynamo cannot take
            # a default there ("invalid handler args ... call_next"), so every compiled candidate failed
            floats = [t.dtype for t in inputs.flatten((args, kwargs)) if t.is_floating_point()]
            args, kwargs = inputs.tree_map(self._convert_in, (args, kwargs))
        out_dtype = floats[0] if floats else self.own_dtype
        if self.router is not None:
            with self.router:
                out = self._call(args, kwargs)
        else:
            out = self._call(args, kwargs)
        if not (self.cast or self.autocast or self.upcast):
            return out
        if type(out) is torch.Tensor:
            return out.to(out_dtype) if out.is_floating_point() else out
        return inputs.tree_map(lambda t: t.to(out_dtype) if t.is_floating_point() else t, out)


def upcasts(original: nn.Module, recipe: Recipe, inplace: bool) -> bool:
    """A float32 recipe over a half-precision model computes from a float32 copy: on a CPU without
    native float16, an fp16 bert-base ran 417 ms a call as given, 134 ms as a float32 copy under
    torch.compile (2-core Zen 5, the thirty-first session; benchmarks/RESULTS.md). Not for a quantized
    model (its weights are tensor subclasses: a cast would dequantize them) nor in place."""
    return (DTYPES[recipe.dtype] == torch.float32 and model_dtype(original) in (torch.float16, torch.bfloat16)
            and not inplace
            and getattr(original, "kiln_quant", None) is None
            and all(type(t) in (torch.Tensor, nn.Parameter) for t in (*original.parameters(), *original.buffers())))


def build_fast(original: nn.Module, recipe: Recipe, sample: inputs.Args | None, inplace: bool,
               applied: list[str], fallbacks: list[Fallback], upcast: bool = False) -> nn.Module:
    """Apply the recipe's passes, looked up in the registry, to a copy of ``original``
    that shares untouched tensors with it (``inplace=True``: to ``original`` itself).
    Each pass that ran appends "name (note)" to ``applied``; one that failed or did
    not apply is recorded in ``fallbacks`` and skipped: it must not cost the others."""
    device = torch.device(recipe.device)
    compute = DTYPES[recipe.dtype]

    def move(t):
        if upcast and t.is_floating_point():  # upcasts(): a float32 copy of a half-precision model
            return t.to(device, torch.float32)
        return t if t.device == device else t.to(device)

    if inplace:
        fast = remake(original, move)
    else:
        # Share parameter and buffer tensors: passes that change a tensor make a new
        # one (passes/tensors.py), so the original stays intact without doubling memory.
        fast = copy_with(original, move)
    fast.eval()
    for cfg in recipe.passes:
        info = registry.lookup(cfg.name)
        ctx = PassContext(device, compute, _sample_for(info.order, sample, device, compute, recipe))
        t0 = time.perf_counter()
        try:
            fast, note = info.apply(fast, cfg, ctx)
        except Skip as e:
            fallbacks.append(Fallback(cfg.name, "skipped", str(e)))
            continue
        except Exception as e:
            fallbacks.append(Fallback(cfg.name, "skipped", f"{type(e).__name__}: {e}"))
            warn_once(f"pass:{cfg.name}:{type(e).__name__}", f"torchkiln: pass {cfg.name} failed and was skipped: {e}")
            continue
        applied.append(f"{cfg.name} ({note})" if note else cfg.name)
        log.debug("pass %s: %s (%.3f s)", cfg.name, note, time.perf_counter() - t0)
    return fast


def _sample_for(order: int, sample, device, compute, recipe: Recipe):
    """The sample as the model sees it at this point: passes after the cast see the
    compute dtype (they run inside the runner's input cast)."""
    if sample is None:
        return None
    cast_order = registry.lookup("cast_dtype").order
    low = recipe.dtype_mode == "cast" and compute != torch.float32 and order > cast_order
    return inputs.to(sample, device, compute if low else None)
