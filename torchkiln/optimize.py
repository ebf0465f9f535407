"""tk.optimize(): validate, plan, apply passes, compile, verify, report.

The returned KilnModule serves calls from the first step of a fallback chain
that works and matches fp32 eager within the recipe's tolerance:

    compiled (full graph) -> compiled (graph breaks) -> eager passes
      -> [the same three at float32, when a lower dtype was planned] -> the original model

Each step down is recorded in the report with the exception or the error seen,
and warned about once. The original model is kept (not copied) for
``state_dict``/``load_state_dict``, the numeric guard and the last fallback.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import threading
import time
import warnings

import torch
from torch import nn

from . import _log, inputs
from .guard import compare
from .hardware import detect
from .passes import (
    cast_dtype,
    channels_last,
    compile_model,
    concat_linear,
    fold_conv_bn,
    fold_linear_bn,
    onednn_linear,
    replace_dropout,
)
from .passes.compile import Compiled
from .passes.onednn_linear import input_rows
from .passes.sdpa_math import SDPARouter
from .plan import INTEL_ONLY, KNOBS, plan
from .recipe import Recipe
from .report import Fallback, Report

log = logging.getLogger(__name__)
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_warned: set = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)
    log.info(msg)


def parse_dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r} is not supported; use torch.float32, torch.bfloat16 or "
                     f"torch.float16 (or the strings {sorted(set(_DTYPES))})")


def _model_device(model: nn.Module) -> torch.device:
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


class _Runner(nn.Module):
    """The fast model plus the per-call input/output conversions, compiled as one
    graph so the casts and layout changes fuse with the first and last kernels."""

    def __init__(self, fast: nn.Module, recipe: Recipe, compute: torch.dtype):
        super().__init__()
        self.fast = fast
        self.cast = recipe.dtype_mode == "cast" and compute != torch.float32
        self.autocast = recipe.dtype_mode == "autocast" and compute != torch.float32
        self.compute = compute
        self.device_type = torch.device(recipe.device).type
        self.channels_last = recipe.memory_format == "channels_last"
        self.router = SDPARouter() if recipe.attention == "auto" else None
        self.calibrated = self.router is None

    def _convert_in(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            if self.cast:
                t = t.to(self.compute)
            if self.channels_last and t.dim() in (4, 5):
                t = t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
        return t

    def calibrate(self, args, kwargs) -> None:
        """One eager call on real inputs, so the attention router can time its choices."""
        if self.calibrated:
            return
        self.router.calibrating = True
        try:
            with torch.no_grad():
                self.forward(*args, **kwargs)
        finally:
            self.router.calibrating = False
            self.calibrated = True

    def _call(self, args, kwargs):
        if self.autocast:
            with torch.autocast(self.device_type, dtype=self.compute):
                return self.fast(*args, **kwargs)
        return self.fast(*args, **kwargs)

    def forward(self, *args, **kwargs):
        out_dtype = next((t.dtype for t in inputs.flatten((args, kwargs)) if t.is_floating_point()), torch.float32)
        args, kwargs = inputs.tree_map(self._convert_in, (args, kwargs))
        if self.router is not None:
            with self.router:
                out = self._call(args, kwargs)
        else:
            out = self._call(args, kwargs)
        if self.cast or self.autocast:
            out = inputs.tree_map(lambda t: t.to(out_dtype) if t.is_floating_point() else t, out)
        return out


def build_fast(original: nn.Module, recipe: Recipe, sample: inputs.Args | None, inplace: bool,
               applied: list[str], fallbacks: list[Fallback]) -> nn.Module:
    """Apply the recipe's eager passes to a copy that shares untouched tensors with ``original``."""
    device = torch.device(recipe.device)
    if inplace:
        fast = original.to(device)
    else:
        # Share parameter and buffer tensors: passes that change a tensor make a new
        # one, so the original stays intact without doubling memory for the rest.
        # (Module.to() would assign param.data in place on the shared Parameters and
        # so move the caller's model too: tensors are moved here, as new objects.)
        memo = {id(t): _on(t, device) for t in itertools.chain(original.parameters(), original.buffers())}
        fast = copy.deepcopy(original, memo)
    fast.eval()
    compute = _DTYPES[recipe.dtype]
    for name in recipe.passes:
        try:
            if name == "replace_dropout":
                fast = replace_dropout(fast)
            elif name == "fold_conv_bn":
                fast = fold_conv_bn(fast)
                name = f"fold_conv_bn ({fast._kiln_folded_conv_bn} folded)"
            elif name == "fold_linear_bn":
                fast = fold_linear_bn(fast)
                name = f"fold_linear_bn ({fast._kiln_folded_linear_bn} folded)"
            elif name == "concat_linear":
                if sample is None:
                    fallbacks.append(Fallback("concat_linear", "skipped", "needs sample_input to see dataflow"))
                    continue
                fast = concat_linear(fast, *inputs.to(sample, device))
            elif name == "cast_dtype":
                fast = cast_dtype(fast, compute, recipe.fp32_modules)
                name = f"cast_dtype ({recipe.dtype}, fp32 kept for {len(recipe.fp32_modules)} module kinds)"
            elif name == "channels_last":
                fast = channels_last(fast)
            elif name == "onednn_linear":
                rows = input_rows(fast, *_runner_inputs(sample, device, compute, recipe)) if sample else None
                fast = onednn_linear(fast, rows)
            applied.append(name)
        except Exception as e:  # one pass failing must not cost the others
            fallbacks.append(Fallback(name, "skipped", f"{type(e).__name__}: {e}"))
            _warn_once(f"pass:{name}:{type(e).__name__}", f"torchkiln: pass {name} failed and was skipped: {e}")
    return fast


def _runner_inputs(sample: inputs.Args, device, compute: torch.dtype, recipe: Recipe) -> inputs.Args:
    """The sample as the fast model sees it inside the runner (device, dtype)."""
    cast = recipe.dtype_mode == "cast" and compute != torch.float32
    return inputs.to(sample, device, compute if cast else None)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if isinstance(t, nn.Parameter):
        return nn.Parameter(t.detach().to(device), requires_grad=t.requires_grad)
    return t.to(device)


class KilnModule(nn.Module):
    """An optimized model. Behaves like the original for calls, ``state_dict``
    and attribute access; ``kiln_report`` says what was done."""

    def __init__(self, original: nn.Module, recipe: Recipe, report: Report,
                 sample: inputs.Args | None, inplace: bool):
        super().__init__()
        object.__setattr__(self, "kiln_original", original)
        object.__setattr__(self, "kiln_recipe", recipe)
        object.__setattr__(self, "kiln_report", report)
        object.__setattr__(self, "_sample", sample)
        object.__setattr__(self, "_inplace", inplace)
        object.__setattr__(self, "_lock", threading.RLock())
        self._reset()

    def _reset(self) -> None:
        object.__setattr__(self, "_fn", None)
        object.__setattr__(self, "_chain", self._steps())

    def _steps(self):
        """Lazily yields (label, callable, runner or None) from fastest to safest."""
        recipes = [self.kiln_recipe]
        if self.kiln_recipe.dtype != "float32":
            recipes.append(self.kiln_recipe.replace(
                dtype="float32", dtype_mode="none", fp32_modules=(),
                passes=tuple(p for p in self.kiln_recipe.passes if p != "cast_dtype")))
        report = self.kiln_report
        for rec in recipes:
            applied: list[str] = []
            fast = build_fast(self.kiln_original, rec, self._sample, self._inplace, applied, report.fallbacks)
            report.applied = applied
            runner = _Runner(fast, rec, _DTYPES[rec.dtype])
            tag = rec.dtype
            if rec.compile:
                opts = dict(rec.compile_options)
                yield f"compiled full graph ({tag})", compile_model(runner, opts, fullgraph=True, private=True), runner
                yield f"compiled with graph breaks ({tag})", compile_model(runner, opts, fullgraph=False, private=True), runner
            yield f"eager passes ({tag})", runner, runner
        report.applied = []
        yield "original model", self.kiln_original, None

    def _advance(self, args, kwargs, reason: str | None) -> object:
        """Step down the chain until a step runs these inputs and passes the guard."""
        report = self.kiln_report
        ref = self._reference(args, kwargs) if self._sample is not None or not self._inplace else None
        tol = self.kiln_recipe.tolerance
        label_prev = report.active
        for label, fn, runner in self._chain:
            if reason is not None:
                report.fallbacks.append(Fallback(label_prev, label, reason))
                _warn_once(f"fb:{id(self)}:{label_prev}", f"torchkiln: {label_prev} -> {label}: {reason}")
            t0 = time.perf_counter()
            try:
                if runner is not None and not runner.calibrated:
                    runner.calibrate(args, kwargs)
                    if runner.router.timings:
                        report.applied.append("sdpa_math: " + runner.router.summary())
                with torch.no_grad():
                    out = fn(*args, **kwargs)
            except Exception as e:
                if fn is self.kiln_original:
                    raise
                reason, label_prev = f"{type(e).__name__}: {_first_line(e)}", label
                if label.startswith("compiled full graph") and not _is_graph_break(e):
                    # The failure is in inductor, not tracing: graph breaks would hit it again.
                    label_prev = "compiled full graph and with graph breaks"
                    next(self._chain)
                continue
            if report.first_call_seconds is None:
                report.first_call_seconds = round(time.perf_counter() - t0, 3)
            if ref is not None and fn is not self.kiln_original:
                err = compare(out, ref)
                report.error, report.tolerance = err.to_dict(), tol
                if not err.ok(tol):
                    reason, label_prev = f"output differs from fp32 eager: {err} > tolerance {tol:g}", label
                    continue
            object.__setattr__(self, "_fn", fn)
            report.active = label
            return inputs.tree_map(torch.clone, out) if self._graphs(fn) else out
        raise RuntimeError("unreachable: the original model ends the chain")

    def _reference(self, args, kwargs):
        """The original model on these inputs (moved to its device): fp32 eager truth."""
        ref_args, ref_kwargs = inputs.to((args, kwargs), _model_device(self.kiln_original))
        with torch.no_grad():
            return self.kiln_original(*ref_args, **ref_kwargs)

    def _flags(self):
        """Backend flags the recipe wants, set for the duration of our call only."""
        if not self.kiln_recipe.cudnn_benchmark:
            return contextlib.nullcontext()
        c = torch.backends.cudnn
        return c.flags(enabled=c.enabled, benchmark=True, deterministic=c.deterministic, allow_tf32=c.allow_tf32)

    def _graphs(self, fn) -> bool:
        return self.kiln_recipe.cuda_graphs and isinstance(fn, Compiled)

    def forward(self, *args, **kwargs):
        with self._flags():
            return self._forward(args, kwargs)

    def _forward(self, args, kwargs):
        fn = self._fn
        if fn is None:
            with self._lock:
                if self._fn is None:
                    return self._advance(args, kwargs, None)
                fn = self._fn
        try:
            if self._graphs(fn):
                # Graph outputs live in a pool the next replay overwrites, and graph
                # trees are per thread: serialise calls and hand out copies.
                with self._lock, torch.no_grad():
                    return inputs.tree_map(torch.clone, fn(*args, **kwargs))
            with torch.no_grad():
                return fn(*args, **kwargs)
        except Exception as e:
            if fn is self.kiln_original:
                raise
            with self._lock:
                # Only step down if eager itself accepts these inputs: a user error
                # (wrong shape) must raise, not degrade the model.
                self._reference(args, kwargs)
                if self._fn is fn:
                    return self._advance(args, kwargs, f"{type(e).__name__}: {_first_line(e)}")
            return self._forward(args, kwargs)

    # The original's checkpoint format, both ways.
    def state_dict(self, *args, **kwargs):
        return self.kiln_original.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = self.kiln_original.load_state_dict(state_dict, strict=strict, assign=assign)
        with self._lock:
            self.kiln_report.fallbacks.clear()
            self.kiln_report.active = "pending first call"
            self._reset()
        if self._sample is not None:
            self(*self._sample[0], **self._sample[1])
        return result

    def _apply(self, fn, *args, **kwargs):
        raise RuntimeError(
            f"this model was optimized for {self.kiln_recipe.device}/{self.kiln_recipe.dtype}; moving or "
            "casting it would invalidate the compiled kernels. Move the original and optimize again: "
            "tk.optimize(model.kiln_original.to(...), ...)")

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("kiln_") or name.startswith("_"):
                raise
            return getattr(self.kiln_original, name)

    def extra_repr(self) -> str:
        return f"device={self.kiln_recipe.device}, dtype={self.kiln_recipe.dtype}, active={self.kiln_report.active!r}"


def optimize(model, dtype=None, level: str = "O1", sample_input=None, device=None, inplace: bool = False,
             optimizer=None, **knobs):
    """Plan and apply the fastest verified recipe for ``model`` on this machine.

    Accepts every ``ipex.optimize`` keyword. Returns an ``nn.Module`` (with
    ``optimizer``: the tuple ``(model, optimizer)``, as IPEX does).
    """
    _log.configure()
    t0 = time.perf_counter()
    _validate_model(model)
    if isinstance(model, KilnModule):
        _warn_once("already", "torchkiln: model is already optimized; returned unchanged. "
                   "To re-plan, call tk.optimize(model.kiln_original, ...)")
        return (model, optimizer) if optimizer is not None else model
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise TypeError(f"optimize() got unknown keyword(s) {sorted(unknown)}; valid knobs: {sorted(KNOBS)}")
    for k in INTEL_ONLY:
        if k in knobs:
            _warn_once(f"intel:{k}", f"torchkiln: {k} is an Intel-IPEX-only knob with no vendor-neutral "
                       "meaning; accepted and ignored")
    if optimizer is not None:
        _warn_once("optimizer", "torchkiln: training optimisation is not implemented yet; model and "
                   "optimizer are returned unchanged")
        return model, optimizer
    if level not in ("O0", "O1", "O2"):
        raise ValueError(f"level={level!r} is not one of 'O0' (nothing), 'O1' (safe default), 'O2' (aggressive)")
    compute = parse_dtype(dtype)
    hw = detect()
    target = _resolve_device(model, device, hw)
    sample = None
    if sample_input is not None:
        sample = inputs.to(inputs.normalize(sample_input), target)
        _check_sample(model, sample)
    recipe = plan(model, hw, str(target), compute, level, knobs,
                  batch=inputs.batch_size(sample) if sample else None)
    if recipe.dtype != str(compute).removeprefix("torch."):
        _warn_once(f"dtype:{compute}:{target}", "torchkiln: " + recipe.notes[0])
    report = Report(recipe=recipe.to_dict())
    kiln = KilnModule(model, recipe, report, sample, inplace)
    if sample is not None:
        kiln(*sample[0], **sample[1])  # compile and verify now, not on the user's first request
    report.optimize_seconds = round(time.perf_counter() - t0, 3)
    log.info("%s", report)
    return kiln


def report(model: nn.Module) -> Report:
    """The report of an optimized model (also ``model.kiln_report``)."""
    if not isinstance(model, KilnModule):
        raise TypeError(f"report() expects a model returned by tk.optimize(), got {type(model).__name__}")
    return model.kiln_report


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else repr(e))[:300]


def _is_graph_break(e: Exception) -> bool:
    unsupported = getattr(getattr(torch, "_dynamo", None), "exc", None)
    return unsupported is not None and isinstance(e, unsupported.Unsupported)


def _validate_model(model) -> None:
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("optimize() got a TorchScript module; torchkiln works on the eager nn.Module "
                        "(TorchScript is deprecated upstream). Pass the model before torch.jit.script/trace.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() expects a torch.nn.Module, got {type(model).__name__}")


def _resolve_device(model: nn.Module, device, hw) -> torch.device:
    target = torch.device(device) if device is not None else _model_device(model)
    if target.type == "cpu":
        return torch.device("cpu")
    if target.index is None:
        target = torch.device(target.type, 0)
    acc = hw.accelerator(str(target))
    if acc is None or not acc.usable:
        why = acc.problem if acc is not None else "not present"
        from .hardware import devices

        raise ValueError(f"device={str(target)!r} is not usable ({why}); usable devices: {devices(hw)}. "
                         "Run `torchkiln doctor` for the cause and fix.")
    return target


def _check_sample(model: nn.Module, sample: inputs.Args) -> None:
    dev = _model_device(model)
    args, kwargs = inputs.to(sample, dev)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:
        raise ValueError(f"sample_input was rejected by the model itself ({type(e).__name__}: {e}); "
                         "pass the tensor, tuple of positional args, or dict of kwargs its forward() takes") from e
