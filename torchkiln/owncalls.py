"""Calls only the original model answers right, whatever tk.optimize serves.

Each of these was answered wrong, silently, before (the twenty-eighth session's probes,
benchmarks/RESULTS.md): a frozen feature network in a perceptual loss dropped its term of the
generator's gradient (rel 1.7e-2: the served forms run without autograd); a hook registered on the
original after optimize never fired, and a pre-hook's edit of a layer's input was ignored; a dropout
layer put in training mode (Monte Carlo dropout) stayed deterministic; and IPEX's documented
trace-and-freeze step failed on the returned model. ``KilnModule.forward`` sends such calls here
(``OwnCalls`` is its mixin); each is warned once and recorded in the report's fallbacks.
"""

from __future__ import annotations

import copy
import operator

import torch

from . import inputs, stock
from ._log import warn_once
from .candidates import OnDevice
from .modelutil import DTYPES, model_device
from .pristine import Pristine
from .report import Fallback

# (which calls, what answers them, why, and how to get the fast path back)
_OWN_CALLS = {
    "grad": ("calls whose inputs require grad (grad mode on)", "the original model (eager, with autograd)",
             "the optimized forms run without autograd, so no gradient would flow back to the inputs; call it "
             "under torch.no_grad(), or with inputs that don't require grad, for the fast path"),
    "training": ("calls while the original or a submodule of it is in training mode", "the original model (eager)",
                 "the model or a submodule was put in training mode after optimize (a parent model's .train(), Monte "
                 "Carlo dropout, BatchNorm statistics): the optimized form runs in eval mode (dropout was "
                 "deterministic, silently); .eval() brings the fast path back, and tk.optimize(model, optimizer=opt) "
                 "trains fast"),
    "functional": ("calls with the original's parameters swapped for other tensors (torch.func.functional_call)",
                   "the original model (eager, with autograd)",
                   "the optimized form holds the weights it was built with; rebuilding it for tensors swapped in for "
                   "one call (and again when they are swapped back) would cost a build per call, and no gradient "
                   "would reach them; call the model itself for the fast path"),
    "transform": ("calls under a torch.func transform (vmap, grad, jacrev, ...)", "the original model (eager)",
                  "the optimized forms are built for plain tensors, and a transform's batched or tracked tensors "
                  "need the model's own operations, which the transform maps (vmap raised on data-dependent "
                  "control flow before); call the model outside the transform for the fast path"),
    "autocast": ("calls under torch.autocast at another dtype than tk.optimize was given",
                 "the original model (eager, under that autocast)",
                 "the optimized form computes at the precision it was optimized and verified for, and autocast "
                 "would make torch.compile recompile it, unverified, at the first such call; tk.optimize(model, "
                 "dtype=<autocast's dtype>) serves that precision fast (with or without autocast around the calls)"),
    "cache": ("calls given a KV cache (past_key_values and the like)", "the original model (eager)",
              # GPT-2: a compiled form failing after it appended left the cache a step ahead, and the original
              # then answered from it, logits 0.85 off (a new-user probe, fiftieth session)
              "the cache is state the call appends to in place, which a compiled form failing part-way would "
              "leave changed; model.generate() of a decoder runs torchkiln's own decoder, and calls without a "
              "cache get the fast path"),
    "tracing": ("calls traced by torch.export or another fake-tensor tracer", "the original model (traced)",
                "the optimized forms hold real weights and compiled kernels a tracer cannot run; export the "
                "original, model.kiln_original"),
    "hooks": ("calls while the original's forward hooks differ from those at optimize", "the original model (eager)",
              "hooks registered (or removed) on the original's modules after optimize: the optimized form does not "
              "call them; remove them, or tk.optimize again with them in place, for the fast path"),
}


def under_transform() -> bool:
    """Inside a torch.func transform (vmap, grad, jacrev, functionalize): 0.1 us."""
    return _peek() is not None


_FAKE = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)


def under_tracer() -> bool:
    """Traced by dynamo (torch.export goes through it) or under this thread's fake-tensor mode: < 1 us.
    Not ``torch.compiler.is_compiling()``: that is one process-wide flag, set while any thread compiles,
    and calls from other threads then ran the original (a new-user probe, fifty-first session: 11 of
    12 bf16 calls answered in float32 while another thread compiled)."""
    return torch.compiler.is_dynamo_compiling() or \
        (_FAKE is not None and torch._C._get_dispatch_mode(_FAKE) is not None)


# keyword arguments that carry a decoder's KV cache into a forward (transformers' names across versions/families)
# ("cache": transformers 5.24's new name for past_key_values)
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache_params", "inference_params", "cache")


def given_cache(kwargs: dict) -> bool:
    """A KV cache handed to this call (an empty one too: the call fills it in place); a flag is not one."""
    return any(kwargs.get(k) is not None and not isinstance(kwargs[k], bool) for k in CACHE_KWARGS)


_peek = getattr(torch._C._functorch, "peek_interpreter_stack", lambda: None)


class OwnCalls:
    def _own_call(self, args, kwargs, key: str):
        """Answer this call with the original model itself; say so once."""
        step, to, why = _OWN_CALLS[key]
        run = OnDevice(self.kiln_original)
        if key == "grad":
            run, to = self._grad_run(run, to)
        fallbacks = self.kiln_report.fallbacks
        if not any(f.step == step and f.to == to for f in fallbacks):
            fallbacks.append(Fallback(step, to, why))
        warn_once(f"{key}:{to}", f"torchkiln: {step} run {to}: {why}", stacklevel=None, owner=self)
        return run(*args, **kwargs)

    def _grad_run(self, original, to: str):
        """What answers calls that need autograd: the original under autocast at the requested
        precision, where that candidate passed the guard and timed faster than the float32 model as
        given (a VGG-style feature net's forward and backward to its input: 2.0x on a 2-core Zen 5,
        gradient within 9% of float32's, as AMP gives), else the original as it is."""
        if self._grad is not None:
            return self._grad
        if self._fn is None:  # nothing measured yet: decided after the first served call
            return original, to
        rec, model = self.kiln_recipe, self.kiln_original
        dtype, device = DTYPES[rec.dtype], model_device(model)
        auto = next((r for r in stock.eager_recipes(dtype) if r.how == "autocast"), None)
        by = {m.name: m for m in self.kiln_report.candidates}
        a, f = (by.get(auto.name), by.get(stock.AS_GIVEN.name)) if auto is not None else (None, None)
        choice = (original, to)
        if a is not None and f is not None and a.status in ("passed", "served") and a.median_ms and f.median_ms \
                and a.median_ms < f.median_ms and device.type == torch.device(rec.device).type:
            choice = (stock.build(auto, model, device),
                      f"the original model under {auto.dtype} autocast (eager, with autograd: the precision asked for, "
                      f"whose forward passed the guard and timed {f.median_ms / a.median_ms:.2f}x the float32 model)")
        object.__setattr__(self, "_grad", choice)
        return choice

    def _with_backward(self, out, args, kwargs):
        """A served call's outputs, made with grad mode on while the original's parameters require grad:
        given a backward that recomputes them with the original (``_EagerBackward``). No parameter needing
        grad (``requires_grad_(False)``, as eager): as they are."""
        if not any(map(_REQUIRES_GRAD, self.kiln_original.parameters())):
            return out
        floats = [t for t in inputs.flatten(out) if t.is_floating_point()]
        if not floats:
            return out
        run = self._grad[0] if self._grad is not None else \
            self._grad_run(OnDevice(self.kiln_original), _OWN_CALLS["grad"][1])[0]
        anchor = torch.empty(0, requires_grad=True)  # makes the outputs part of the autograd graph
        new = dict(zip(map(id, floats), _EagerBackward.apply(run, self.kiln_original, args, kwargs, anchor, *floats), strict=True))
        return inputs.map_tensors(lambda t: new.get(id(t), t), out)

    def _traced_call(self, args, kwargs):
        """Under ``torch.jit.trace``, which IPEX's documented flow runs on the optimized model (trace,
        then freeze): the original's operations, its weights as constants, which is what freezing a
        trace of the original gives. Before, the trace failed ("Cannot insert a Tensor that requires
        grad as a constant"): the weights belong to the original, not to the module traced. A trace
        cannot call the served form (compiled code, or TorchScript not registered under it)."""
        warn_once("jit.trace", "torchkiln: torch.jit.trace of the model tk.optimize returned records the original "
                  f"model's operations (weights as constants), not what torchkiln serves ({self.kiln_report.active}); "
                  "IPEX needed trace and freeze, torchkiln does not: call the returned model instead",
                  stacklevel=None, owner=self)
        tracing = torch._C._get_tracing_state()
        torch._C._set_tracing_state(None)  # the copy is not the model's work: left out of the trace
        try:  # a copy whose weights need no grad, so the tracer takes them as constants (functional_call refuses)
            model = copy.deepcopy(self.kiln_original).requires_grad_(False)
        finally:
            torch._C._set_tracing_state(tracing)
        return model(*args, **kwargs)

    def __prepare_scriptable__(self):
        """``torch.jit.script`` asks this of every module first: it scripts the original (its code and
        parameters, shared with it, as scripting it directly would), because what torchkiln serves is
        not scriptable code. Before, scripting the returned model raised NotSupportedError on its
        ``*args`` forward, where scripting the user's model worked."""
        warn_once("jit.script", "torchkiln: torch.jit.script of the model tk.optimize returned scripts the original "
                  f"model, not what torchkiln serves ({self.kiln_report.active}): call the returned model instead",
                  stacklevel=None, owner=self)
        return self.kiln_original


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _EagerBackward(torch.autograd.Function):
    """The served forms run without autograd. Called with grad mode on (no ``torch.no_grad()``), eager's
    outputs carry a graph to the parameters, and ``loss.backward()`` filled their ``.grad``; the served
    outputs had none, and backward raised "element 0 of tensors does not require grad" (the thirtieth
    session's probes). Here backward runs the original again on the call's inputs, with autograd, and
    sends the incoming gradients through it: eager's parameter gradients, recomputed as activation
    checkpointing does, paid only when backward is called (inputs changed in place before it change
    the recomputation, as with checkpointing; state the rerun changes in the model is put back)."""

    @staticmethod
    def forward(ctx, run, model, args, kwargs, anchor, *outs):
        ctx.run, ctx.model, ctx.args, ctx.kwargs = run, model, args, kwargs
        ctx.set_materialize_grads(False)  # an output the loss did not use: None, so its layers keep .grad None
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        # The rerun is not a call of the user's: state the forward keeps (a call counter, a stored map) is put
        # back as it was, as tk.optimize's own runs are (pristine.py).
        snap = Pristine(ctx.model, ctx.args, ctx.kwargs)
        try:
            with torch.enable_grad():
                again = [t for t in inputs.flatten(ctx.run(*ctx.args, **ctx.kwargs)) if t.is_floating_point()]
            pairs = [(o, g.to(o.dtype)) for o, g in zip(again, grads, strict=True)
                     if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            snap.restore()
        return (None, None, None, None, None, *(None for _ in grads))
