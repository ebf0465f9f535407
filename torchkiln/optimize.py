"""tk.optimize(): validate, plan, then serve the fastest verified candidate.

At ``sample_input`` (or the first call) every candidate (candidates.py) is built,
run, compared with the original model by the numeric guard (guard.py), and the
ones that pass are timed against each other in interleaved rounds. The fastest
serves calls; the report keeps every measurement. Later:

- a new input-shape signature is verified again (``verify="shapes"``, the first
  few signatures);
- a failure that is not the user's (the original accepts the inputs) steps down
  to the next candidate in measured order, only if that one passes on the same
  inputs; an out-of-memory error is re-raised, never a reason to step down;
- a change of the original's weights (load_state_dict, an EMA update, ``p.data = t``,
  a new Parameter) is noticed through tensor version counters, storage pointers and
  the modules' parameter slots, and the served candidate rebuilt;
- the runs that choose (reference, candidates, timing) leave no trace: buffers, plain
  attributes and input tensors a run changed in place are put back (pristine.py), and
  the caller's call then runs once for real.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from . import _log, hostmem, inputs
from ._log import quiet_deprecations, warn_once
from .candidates import Candidate, applied_for, candidates, keeping_inputs, keeping_state, upcast_wins
from .face import OriginalFace
from .guard import compare_each, tf32_allowed, tolerances, verdict
from .hardware import detect, resolve_device
from .hookwatch import HookWatch
from .modelutil import (
    DTYPES,
    dtype_name,
    eval_mode,
    first_line,
    has_conv,
    is_causal_lm,
    is_oom,
    model_device,
    model_dtype,
    parse_dtype,
    swapped_parameters,
    training_module,
)
from .owncalls import OwnCalls, given_cache, under_tracer, under_transform
from .passes.compile import CompileTimeout, compiling_late
from .plan import INTEL_ONLY, KNOBS, SERVING_KNOBS, plan, serving_knobs
from .pristine import Pristine, per_call_state
from .progress import ticks
from .recipe import LEVELS, Recipe
from .report import Fallback, Measurement, Report
from .timing import blocks, interleaved
from .watch import WeightWatch

log = logging.getLogger(__name__)
VERIFY = ("shapes", "first", "off")
OOM = "out of memory (skipped)"
SCOPES = ("auto", "torchkiln")
VERIFIED_SHAPES = 4  # verify="shapes": how many input signatures are checked against the original
MAX_DETOURS = 8  # call forms the served candidate fails on, each sent one step down on its own; then all are
SHAPE_BUDGET = 0.25  # s: timing the served form against the model as given at each new input signature verified
SHAPE_MARGIN = 1.05  # ... and serving the model as given there when the served form is slower than this
# A first reading within SHAPE_CLOSE of the model as given (served/given above 1/SHAPE_CLOSE) that kept the
# served form is taken again at that signature's SHAPE_RECHECK-th call, warm: of 28 first readings of a
# 1.16-1.19x slowdown (blocks sized by a warm call, block means), 2 read 1.01-1.05 and kept it
# (diag_shape_rule.py --fresh; RESULTS.md, thirty-fifth session)
SHAPE_CLOSE = 1.15
SHAPE_RECHECK = 64
SLOWER = 0.95  # quantize=: below this ratio to the float model as given, warn (timing noise on a 2-core VM is ~3%)
# nn.Module.__call__ as imported. torch.fx's tracer replaces nn.Module.__call__ process-wide while
# it traces, so a second thread calling the model during another thread's first-call setup
# (which traces) went through the tracer and failed ("module is not installed as a submodule",
# test_concurrent_first_call_without_sample_selects_once, 1 run in CI); bound here, the call
# reaches forward's lock and waits for the setup instead.
_MODULE_CALL = getattr(nn.Module, "_wrapped_call_impl", nn.Module.__call__)  # what __call__ is, unpatched


class KilnModule(OwnCalls, OriginalFace):
    """An optimized model that behaves like the original: calls, parameters,
    buffers, modules, ``state_dict`` both ways, attribute access, no-op moves.
    ``kiln_report`` says what serves the calls and why."""

    def __init__(self, original: nn.Module, recipe: Recipe, report: Report, sample: inputs.Args | None,
                 inplace: bool, verify: str, scope: str, time_budget: float, reference=None,
                 upcast: Recipe | None = None):
        super().__init__()
        s = object.__setattr__
        s(self, "kiln_original", original)
        s(self, "kiln_recipe", recipe)
        s(self, "kiln_report", report)
        s(self, "_sample", sample)
        s(self, "_opts", {"inplace": inplace, "verify": verify, "scope": scope, "time_budget": time_budget,
                          "upcast": upcast})
        s(self, "_lock", threading.RLock())
        s(self, "_sample_ref", reference)  # inplace=True: the untouched model's output on the sample
        s(self, "training", False)  # it serves inference (nn.Module.__init__ said True)
        s(self, "_llm", None)  # generate()'s (tk.llm copy, or None where it failed; the weight state it read)
        s(self, "_state_names", None)  # what the forward changes at every call (per_call_state; None: not probed)
        self._show_signature()
        self._reset(choice=None)

    # ----------------------------------------------------------------- state
    def _reset(self, choice: str | None) -> None:
        s = object.__setattr__
        o = self._opts
        cands = candidates(self.kiln_original, self.kiln_recipe, self._sample, o["inplace"], o["scope"],
                           self.kiln_report.fallbacks, o.get("upcast"))
        if self._state_names:
            cands = keeping_state(cands, self._state_names, self.kiln_original, self.kiln_report.fallbacks)
        if getattr(self, "_writes_inputs", False):
            cands = keeping_inputs(cands, self.kiln_original, self.kiln_report.fallbacks)
        s(self, "_cands", cands)
        s(self, "_choice", choice)  # name of the candidate to rebuild (after a weight change or a copy)
        s(self, "_fn", None)
        s(self, "_served", None)
        s(self, "_order", [])  # candidate names to step down to, in order
        s(self, "_tols", None)
        s(self, "_shapes", set())
        s(self, "_watch", WeightWatch(self.kiln_original))
        s(self, "_hooks", HookWatch(self.kiln_original))
        s(self, "_snap", None)  # Pristine, while a selection runs
        s(self, "_swap", {})  # candidate name -> what replaced it (fullgraph -> graph breaks)
        s(self, "_own", None)  # "training" while calls must run the original itself (see forward)
        s(self, "_grad", None)  # (callable, words): what answers calls that need autograd (_grad_run)
        s(self, "_detours", {})  # signature -> Detour: call forms the served one failed on, or was slower on
        s(self, "_undetoured", set())  # signatures whose transient detour has ended (Detour)
        s(self, "_recheck", {})  # signature -> its calls left before its second reading (SHAPE_RECHECK)
        # (device type, dtype optimized for), read by every call's autocast check (_under_autocast)
        s(self, "_amp", (torch.device(self.kiln_recipe.device).type, DTYPES.get(self.kiln_recipe.dtype)))

    def __getstate__(self):
        # Compiled code, locks and graph pools don't copy or pickle: a copy keeps the
        # decision (which candidate serves) and rebuilds it on its first call.
        return {"original": self.kiln_original, "recipe": self.kiln_recipe, "report": self.kiln_report,
                "sample": self._sample, "opts": self._opts, "choice": self._choice or self.kiln_report.active,
                "sample_ref": self._sample_ref, "training": self.training, "state_names": self._state_names}

    def __setstate__(self, state):
        nn.Module.__init__(self)
        s = object.__setattr__
        s(self, "kiln_original", state["original"])
        s(self, "kiln_recipe", state["recipe"])
        s(self, "kiln_report", state["report"])
        s(self, "_sample", state["sample"])
        s(self, "_opts", state["opts"])
        s(self, "_lock", threading.RLock())
        s(self, "_sample_ref", state["sample_ref"])
        s(self, "training", state["original"].training)
        s(self, "_llm", None)
        s(self, "_state_names", state.get("state_names"))
        self._show_signature()
        choice = state["choice"]
        self._reset(choice=choice if choice != "pending first call" else None)

    # ------------------------------------------------------------------ calls
    def __call__(self, *args, **kwargs):
        return _MODULE_CALL(self, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if torch.jit.is_tracing():
            return self._traced_call(args, kwargs)
        if under_transform():
            return self._own_call(args, kwargs, "transform")
        if under_tracer():
            return self._own_call(args, kwargs, "tracing")
        if kwargs and given_cache(kwargs):
            return self._own_call(args, kwargs, "cache")
        if torch.is_grad_enabled() and inputs.need_grad(args, kwargs):
            return self._own_call(args, kwargs, "grad")
        if self._own is not None:  # a submodule was put in training mode (found by _refresh)
            if training_module(self.kiln_original) is not None:
                return self._own_call(args, kwargs, self._own)
            object.__setattr__(self, "_own", None)  # back in eval mode: the weight check below decides the rest
        served = self._served
        if served is not None and not served.live_weights and self._hooks.changed():
            return self._own_call(args, kwargs, "hooks")  # (live_weights: it runs the original's modules)
        if torch.is_autocast_enabled(self._amp[0]):  # 0.1 us; below the calls the original answers
            return self._under_autocast(args, kwargs)
        if torch.is_inference_mode_enabled():  # 0.1 us
            return self._out_of_inference_mode(args, kwargs)
        fn = self._fn
        new_shape, sig = self._check_shape(args, kwargs) if fn is not None else (False, None)
        # A CUDA-graph replay is checked for changed weights after it is queued, while the GPU runs it:
        # checked before, the 13-61 us of version reads were added to every call (H200 host, RESULTS.md,
        # fourteenth session). An answer computed from old weights is then dropped and recomputed.
        late = fn is not None and not new_shape and self._served.cuda_graphs
        if fn is None or (not late and not self._served.live_weights and self._stale()):
            out = self._refresh(args, kwargs)
            if out is not _RACED:
                return out
            fn = self._fn
            new_shape, sig = self._check_shape(args, kwargs)
        if self._detours:
            sig = sig or inputs.signature(args, kwargs)
            detour = self._detours.get(sig)
            if detour is not None and (detour.until is None or detour.until()):
                if not detour.cand.live_weights and self._stale():
                    return self._refreshed(args, kwargs)
                return self._serve(detour.fn, args, kwargs, detour.cand)
            if detour is not None:  # its cause has passed: these calls go back to the served form
                self._end_detour(sig, detour)
        if new_shape:
            with self._lock, self._pristine(args, kwargs):
                return self._verify_shape(args, kwargs)
        try:
            out = self._serve(fn, args, kwargs)
        except Exception as e:
            if is_oom(e) or self._served.kind == "original":
                raise
            if late and self._stale():  # the new weights, not the candidate, may be what failed
                return self._refreshed(args, kwargs)
            with self._lock:
                if self._fn is fn:
                    with self._pristine(args, kwargs):
                        return self._step_down(args, kwargs, f"{type(e).__name__}: {first_line(e)}",
                                               detour=inputs.signature(args, kwargs) not in self._shapes,
                                               until=self._transient(e, args, kwargs))
            return self._again(*args, **kwargs)
        if late and self._stale():
            return self._refreshed(args, kwargs)
        return out

    def _under_autocast(self, args, kwargs):
        """A call under the caller's torch.autocast, as IPEX's bf16 inference recipe makes it
        (``ipex.optimize(model, dtype=torch.bfloat16)``, then calls under ``torch.cpu.amp.autocast()``).
        Its dtype the one optimized for: served with autocast off inside, the form verified at that
        precision; left on, torch.compile recompiled the served graph at the first such call (bert-base
        bf16: a 12.4 s call, a second graph, its output never verified). Another dtype: the original
        under that autocast, as eager would answer (owncalls.py says why)."""
        device, dtype = self._amp
        if torch.get_autocast_dtype(device) != dtype:
            return self._own_call(args, kwargs, "autocast")
        with torch.autocast(device, enabled=False):
            return self._again(*args, **kwargs)

    def _out_of_inference_mode(self, args, kwargs):
        """A call under ``torch.inference_mode()`` (serving stacks' usual context, where selection and
        IPEX's examples use no_grad): dynamo guards each input's dispatch keys, which inference mode
        changes, so the served graph, compiled under no_grad, was compiled again at the first such call
        (bert-base bf16: a 14.0 s call, never verified). Served under no_grad instead, with inputs made
        in inference mode copied out of it (an inference tensor's keys differ whatever the mode);
        outputs are then ordinary tensors. Inputs changed in place by the model change the copies."""
        with torch.inference_mode(False), torch.no_grad():
            args, kwargs = inputs.out_of_inference((args, kwargs))
            return self._again(*args, **kwargs)

    def _refresh(self, args, kwargs):
        """Set up (first call) or rebuild (the original's weights changed) and answer this call;
        _RACED when another thread did it first."""
        with self._lock:
            if self._fn is None or self._stale():
                if swapped_parameters(self.kiln_original):  # for this call only: no setup, no rebuild
                    return self._own_call(args, kwargs, "functional")
                if training_module(self.kiln_original) is not None:
                    # No rebuild: the snapshot stays the built form's, so once back in eval mode
                    # (with nothing else changed) calls are served again as they were.
                    object.__setattr__(self, "_own", "training")
                    return self._own_call(args, kwargs, "training")
                if self._fn is not None:
                    self._reset(choice=self.kiln_report.active)
                    log.info("torchkiln: the original's weights changed; rebuilding %s", self._choice)
                with self._pristine(args, kwargs):
                    out = self._setup(args, kwargs)
                # What the selection's snapshot, failed builds and their reference cycles held goes
                # now, and the heap it leaves back to the OS (hostmem.py): bert-base bf16 on the CPU
                # stayed 0.53 GB above its live memory after optimize(), and 0.17 GB with the trim alone.
                if hostmem.worth_returning(self.kiln_original):
                    gc.collect()
                    hostmem.give_back()
                return out
        return _RACED

    def _refreshed(self, args, kwargs):
        out = self._refresh(args, kwargs)
        return self._again(*args, **kwargs) if out is _RACED else out

    @contextlib.contextmanager
    def _pristine(self, args, kwargs):
        """A snapshot for the runs of one selection (nested calls share it)."""
        if self._snap is not None:
            yield
            return
        object.__setattr__(self, "_snap", Pristine(self.kiln_original, args, kwargs))
        try:
            with quiet_deprecations():  # builds and compiles happen inside (_log.py says why)
                yield
        finally:
            object.__setattr__(self, "_snap", None)

    def _restore(self) -> None:
        if self._snap is not None:
            self._snap.restore()

    def _replaced_state(self) -> list[str]:
        """Buffers the runs so far replaced (found when put back)."""
        if self._snap is None:
            return []
        self._snap.restore()
        return self._snap.replaced

    def _for_real(self, fn, args, kwargs):
        """The caller's call, after the choosing runs: from the state they found, once."""
        self._restore()
        self._remember_weights()
        return self._serve(fn, args, kwargs)

    def _inference_only(self) -> None:
        # the flag first (a call's cost), then optimize()'s own test: a model whose modules all act alike
        # in both modes (Linear layers, say) is taken in training mode, and its first call raised this
        if self.kiln_original.training and training_module(self.kiln_original) is not None:
            raise RuntimeError("the original model was put in training mode after tk.optimize(); the optimized "
                               "model serves inference only. Call model.eval() on it, or optimize with optimizer= "
                               "for training")

    def _serve(self, fn, args, kwargs, cand: Candidate | None = None):
        self._inference_only()
        grad = torch.is_grad_enabled()
        if (cand or self._served).copy_outputs:
            # Graph outputs live in a pool the next replay overwrites, and graph trees
            # are per thread: serialise calls and hand out copies.
            with self._lock, torch.no_grad():
                out = inputs.clone(fn(*args, **kwargs))
        elif not grad:  # the usual inference call: no_grad's context costs 1 of the ~10 us this wrapper adds
            return fn(*args, **kwargs)
        else:
            with torch.no_grad():
                out = fn(*args, **kwargs)
        return self._with_backward(out, args, kwargs) if grad else out

    def _stale(self) -> bool:
        return self._watch.changed()

    def _remember_weights(self) -> None:
        if self._snap is not None:  # the model's own state (a counter): not weights or settings
            self._watch.ignore(self._snap.mutated, self._snap.mutated_attrs)
        # the C check is built only where it will run on every call
        self._watch.remember(native=self._served is not None and not self._served.live_weights)
        self._hooks.remember()

    def kiln_refresh(self) -> None:
        """Rebuild the served candidate from the original's weights on the next call (``tk.refresh``)."""
        with self._lock:
            if self._fn is not None:
                self._reset(choice=self.kiln_report.active)
            object.__setattr__(self, "_llm", None)

    # ------------------------------------------------------------- reference
    def _reference(self, args, kwargs):
        """The original model, in eval mode, on these inputs (moved to its device)."""
        if self._opts["inplace"]:
            return None  # its weights are the optimized ones now: no untouched truth
        model = self.kiln_original
        ref_args, ref_kwargs = inputs.to((args, kwargs), model_device(model))
        if self._low_inputs(args, kwargs):  # the values given, in the float32 model's own precision
            ref_args, ref_kwargs = inputs.to((ref_args, ref_kwargs), dtype=torch.float32)
        self._restore()
        with eval_mode(model), torch.no_grad():
            if model_dtype(model) in (torch.bfloat16, torch.float16):
                truth = _float32_truth(model, ref_args, ref_kwargs)
                if truth is not None:
                    return truth
                self._restore()
            return model(*ref_args, **ref_kwargs)

    def _low_inputs(self, args, kwargs) -> bool:
        """Inputs in the half precision a float32 model was optimized for (``x.bfloat16()`` after
        ``tk.optimize(model, dtype=torch.bfloat16)``, which IPEX's bf16 weights took): the served form
        takes them and answers in their dtype; the guard's truth is the model on their float32 values."""
        low = DTYPES.get(self.kiln_recipe.dtype)
        if low not in (torch.bfloat16, torch.float16) or model_dtype(self.kiln_original) != torch.float32:
            return False
        return any(t.dtype == low for t in inputs.flatten((args, kwargs)) if t.is_floating_point())

    def _probe_state(self, args, kwargs) -> None:
        """Find what the original's forward changes at every call (pristine.per_call_state) and, if
        anything, leave only the candidates that keep it as eager does. A counter or stored attention
        maps were left behind by every traced or compiled candidate (the twenty-ninth session's probes)."""
        names: list[str] = []
        writes_inputs = False
        if not self._opts["inplace"]:  # inplace: the transformed model is the caller's own
            model = self.kiln_original
            a, k = inputs.to((args, kwargs), model_device(model))
            # an in-place write to an input moves its counter (inference tensors keep none)
            given = [t for t in inputs.flatten((a, k)) if not t.is_inference()]
            versions = [t._version for t in given]

            def run():
                with eval_mode(model), torch.no_grad():
                    model(*a, **k)
            self._restore()
            names = per_call_state(model, run)
            writes_inputs = any(t._version != v for t, v in zip(given, versions, strict=True))
            self._restore()
        object.__setattr__(self, "_state_names", names)
        object.__setattr__(self, "_writes_inputs", writes_inputs)
        if names:
            object.__setattr__(self, "_cands", keeping_state(self._cands, names, self.kiln_original,
                                                             self.kiln_report.fallbacks))
        if writes_inputs:
            object.__setattr__(self, "_cands", keeping_inputs(self._cands, self.kiln_original,
                                                              self.kiln_report.fallbacks))

    def _mark_verified(self, args, kwargs) -> None:
        self._shapes.add(inputs.signature(args, kwargs))
        self.kiln_report.verified_shapes = len(self._shapes) if self._tols is not None else 0

    def _check_shape(self, args, kwargs) -> tuple[bool, tuple | None]:
        """(a new signature to verify, or one whose second reading is due (SHAPE_RECHECK); the call's
        signature where it was needed for that, else None: the detour lookup reuses it)."""
        if self._opts["verify"] != "shapes" or (len(self._shapes) >= VERIFIED_SHAPES and not self._recheck):
            return False, None
        sig = inputs.signature(args, kwargs)
        if sig not in self._shapes:
            return len(self._shapes) < VERIFIED_SHAPES, sig
        left = self._recheck.get(sig)
        if left is None:
            return False, sig
        self._recheck[sig] = left - 1  # unlocked: a lost count between threads only moves the reading a call
        return left <= 1, sig

    # ------------------------------------------------------------- selection
    def _setup(self, args, kwargs):
        """First call (or rebuild): verify and time candidates, serve the fastest."""
        report = self.kiln_report
        t0 = time.perf_counter()
        verify = self._opts["verify"] != "off"
        ref = None
        if verify:
            ref = self._reference(args, kwargs)
            if ref is None and self._sample_ref is not None and self._sample is not None \
                    and inputs.signature(args, kwargs) == inputs.signature(*self._sample):
                ref = self._sample_ref
        if self._state_names is None:
            self._probe_state(args, kwargs)
        measures = {m.name: m for m in report.candidates}
        if self._choice is not None:
            out = self._rebuild(args, kwargs, ref, measures)
            if out is not _FAILED:
                return out
        verdicts: dict[str, object] = {}
        passed: dict[str, object] = {}
        for tier in sorted({c.tier for c in self._cands}):
            for cand in [c for c in self._cands if c.tier == tier and c.kind != "original"]:
                m = measures.setdefault(cand.name, Measurement(cand.name, cand.kind, cand.dtype))
                fn = out = None  # the last one's: _make_room may free it
                needless = cand.skip(passed) if cand.skip is not None else None
                if needless:
                    m.status, m.reason = "skipped", needless
                    continue
                short = self._no_room(cand)
                if short and self._make_room(passed, verdicts, args, kwargs, measures):
                    short = self._no_room(cand)
                if short:  # said only now: room made above is no skip
                    warn_once("hostmem", f"torchkiln: not enough host memory to build every candidate side by side "
                              f"({cand.name}: {short.removeprefix('not built: ')}); the ones that don't fit are "
                              "skipped. See tk.report(model).", owner=self)
                    m.status, m.reason = "skipped", short
                    continue
                fn, out, why = self._try(cand, args, kwargs, measures)
                if why == OOM and self._make_room(passed, verdicts, args, kwargs, measures):
                    fn, out, why = self._try(cand, args, kwargs, measures)
                tick = getattr(self, "_tick", None)  # set by optimize(progress=True) around its sample call
                if tick:
                    tick()
                if fn is None:
                    m.status, m.reason = "failed", why
                    continue
                cand = self._current(cand)
                m = measures[cand.name]
                if ref is not None:
                    if self._tols is None:
                        self._set_tolerances(out, ref, cand)
                    v = verdict(out, ref, self._tols)
                    if not v.ok:
                        m.status, m.reason = "failed", f"output differs from the original: {v}"
                        continue
                if not cand.serve:
                    m.status, m.reason = "baseline only", "sets the guard's tolerance (candidates='torchkiln')"
                    continue
                m.status, m.reason = "passed", ""
                passed[cand.name] = fn
                # The guard's verdict now: a CUDA-graph output is overwritten by the timing runs.
                verdicts[cand.name] = verdict(out, ref, self._tols) if ref is not None and self._tols else None
            # Only the model as given in float32 passing (every bf16 one over the guard's tolerance: a
            # random-init MobileNetV2's plain bf16 cast is 10% off, over the 5% cap) goes on to the next
            # tier, torchkiln's float32 recipe: it served eager float32 at 0.2x IPEX before (RESULTS.md)
            if any(c.dtype == self.kiln_recipe.dtype or c.kind != "eager" for c in map(self._find, passed)):
                break
        report.candidates = list(measures.values())
        replaced = self._replaced_state()
        if replaced:
            # Only the model's own modules can carry state kept by replacing a tensor: a copy (cast,
            # traced, compiled) would replace its own, and the original's would never advance.
            return self._serve_original(args, kwargs, ref, f"forward replaces buffer(s) {', '.join(replaced[:3])} "
                                        "with new tensors (state only the model's own modules keep)")
        if not passed:
            return self._serve_original(args, kwargs, ref, "no candidate passed the numeric guard")
        ts = time.perf_counter()
        if len(passed) > 1:
            self._time(passed, args, kwargs, measures)
            if not passed:
                return self._serve_original(args, kwargs, ref, "every candidate failed on repeated calls")
        report.selection_seconds = round(time.perf_counter() - ts, 3)
        timed = {n: measures[n].median_ms for n in passed if measures[n].median_ms is not None}
        best = min(timed, key=timed.get) if timed else next(iter(passed))
        order = sorted(passed, key=lambda n: timed.get(n, float("inf")))
        fn = passed[best]
        self._install(best, fn, order)
        self._close_to_given(args, kwargs, measures)
        self._after_select(verdicts[best], measures)
        # The losers' copies and compiled graphs go now, not at the next garbage collection
        # (compiled wrappers are reference cycles): bert-base bf16 on the H200 kept 3 cast copies and
        # their graphs resident otherwise (benchmarks/diag_memory.py). Rebuilt from the candidate list if needed.
        losers = len(passed) > 1
        passed.clear()
        out = None  # the last candidate's output (a loser's, possibly in its CUDA-graph pool)
        if losers:
            gc.collect()
        if report.first_call_seconds is None:
            report.first_call_seconds = round(time.perf_counter() - t0, 3)
        self._mark_verified(args, kwargs)
        return self._for_real(fn, args, kwargs)

    def _make_room(self, passed: dict, verdicts: dict, args, kwargs, measures) -> bool:
        """The next candidate does not fit beside those built so far: time these against each other,
        keep the fastest and free the other copies, so it can still be built and compete (before, it
        was skipped: on a host with room for two copies of a model, torchkiln's own recipe, built after
        the eager ones, never ran). The freed ones keep their times in the report. False: nothing to free."""
        copies = [n for n in passed if not self._find(n).live_weights]
        if len(passed) < 2 or not copies:
            return False
        self._time(passed, args, kwargs, measures)
        timed = {n: measures[n].median_ms for n in passed if measures[n].median_ms is not None}
        keep = min(timed, key=timed.get) if timed else None
        drop = [n for n in copies if n != keep and n in passed]
        if not drop:
            return False
        for name in drop:
            passed.pop(name)
            verdicts.pop(name, None)
            measures[name].reason = "timed against the candidates built before it, then freed to make room for " \
                                    "the next (memory)"
        log.info("torchkiln: freed %s to make room for the next candidate", ", ".join(drop))
        gc.collect()
        if torch.device(self.kiln_recipe.device).type == "cuda":
            torch.cuda.empty_cache()
        else:
            hostmem.give_back()
        return True

    def _no_room(self, cand: Candidate) -> str | None:
        """Why ``cand`` is not built beside the others: the host would run out of memory (hostmem.py).
        On CUDA, torch raises OutOfMemoryError instead: _setup makes room once, then skips it."""
        if cand.live_weights or torch.device(self.kiln_recipe.device).type != "cpu":
            return None
        need = hostmem.build_bytes(self.kiln_original, DTYPES.get(cand.dtype, torch.float32), cand.kind != "eager")
        free = hostmem.available_bytes()
        if hostmem.fits(need, free):
            return None
        return f"not built: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB of host memory available"

    def _rebuild(self, args, kwargs, ref, measures):
        """After a weight change or a copy: rebuild the candidate that was chosen, keep
        the decision if it still passes; otherwise a full selection follows."""
        cand = next((c for c in self._cands if c.name == self._choice), None)
        if cand is None or cand.kind == "original":
            return self._serve_original(args, kwargs, ref, "the original model was serving") if cand else _FAILED
        fn, out, why = self._try(cand, args, kwargs, measures)
        if fn is not None and ref is not None and self._tols is not None and not verdict(out, ref, self._tols).ok:
            why = f"output differs from the original: {verdict(out, ref, self._tols)}"
        if why is not None or fn is None:
            self.kiln_report.fallbacks.append(Fallback(self._choice, "a new selection", f"rebuild failed: {why}"))
            object.__setattr__(self, "_choice", None)
            return _FAILED
        cand = self._current(cand)
        self._install(cand.name, fn, [cand.name] + [c.name for c in self._cands if c.name != cand.name])
        self._mark_verified(args, kwargs)
        return self._for_real(fn, args, kwargs)

    def _try(self, cand: Candidate, args, kwargs, measures) -> tuple:
        """Build and run once. Returns (callable, output, None) or (None, None, reason)."""
        t0 = time.perf_counter()
        try:
            fn = cand.make()
            self._restore()
            with torch.no_grad():
                out = fn(*args, **kwargs)
            self._built(measures, cand, t0)
            return fn, out, None
        except Exception as e:
            self._built(measures, cand, t0)
            if is_oom(e):
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                return None, None, OOM
            reason = f"{type(e).__name__}: {first_line(e)}"
            step = cand.graph_breaks if _is_graph_break(e) else cand.python_wrapper
            if step is not None:  # one level down, recorded
                alt = step()
                self._replace(cand, alt)
                measures[cand.name].status, measures[cand.name].reason = "failed", reason
                measures[alt.name] = Measurement(alt.name, alt.kind, alt.dtype)
                self.kiln_report.fallbacks.append(Fallback(cand.name, alt.name, reason))
                return self._try(alt, args, kwargs, measures)
            return None, None, reason

    @staticmethod
    def _built(measures: dict, cand: Candidate, t0: float) -> None:
        if cand.name in measures:  # a rebuild's or a later step's time replaces the first
            measures[cand.name].build_seconds = round(time.perf_counter() - t0, 2)

    def _replace(self, old: Candidate, new: Candidate) -> None:
        self._cands[self._cands.index(old)] = new
        self._swap[old.name] = new

    def _current(self, cand: Candidate) -> Candidate:
        while cand.name in self._swap:
            cand = self._swap[cand.name]
        return cand

    def _set_tolerances(self, out, ref, cand: Candidate) -> None:
        dtype = DTYPES[self.kiln_recipe.dtype]
        n = len(compare_each(out, ref))
        baseline = None
        if dtype != torch.float32 and cand.kind == "eager" and "cast" in cand.name:
            baseline = compare_each(out, ref)  # the plain cast: what this precision costs here
        quant = getattr(self.kiln_original, "kiln_quant", None)
        if quant is not None:  # the reference is the eager quantized model
            from .quantization.plan import tolerances as quant_tolerances

            object.__setattr__(self, "_tols", quant_tolerances(quant, n))
            return
        tf32 = tf32_allowed(torch.device(self.kiln_recipe.device), has_conv(self.kiln_original))
        object.__setattr__(self, "_tols", tolerances(dtype, baseline, n, tf32))

    def _time(self, passed: dict, args, kwargs, measures) -> None:
        dev = torch.device(self.kiln_recipe.device)
        warm = 3 if dev.type == "cuda" else 1  # CUDA graph trees record on the 2nd/3rd call
        fns, errors = {}, {}
        for name, fn in passed.items():
            call = (lambda fn=fn: inputs.clone(fn(*args, **kwargs))) if self._find(name).copy_outputs else \
                (lambda fn=fn: fn(*args, **kwargs))
            if self._snap is not None and self._snap.changed:  # a model that writes its state or inputs
                call = _after(self._restore, call)
            try:
                with torch.no_grad():
                    for _ in range(warm):
                        call()
            except Exception as e:
                if is_oom(e):
                    raise
                errors[name] = e
                continue
            fns[name] = call
        with torch.no_grad():
            times = interleaved(fns, dev, self._opts["time_budget"], errors=errors, streams=True)
        for name, e in errors.items():  # failed on a repeat call: never serve it
            measures[name].status, measures[name].reason = "failed", f"on a repeated call: {type(e).__name__}: " \
                f"{first_line(e)}"
            passed.pop(name)
        for name, ts in times.items():
            measures[name].median_ms = round(statistics.median(ts) * 1e3, 4)
            measures[name].calls_timed = len(ts)

    def _close_to_given(self, args, kwargs, measures) -> None:
        """The selection times one call of each candidate in turn, and each call pays the switch from the
        one before: for calls well under a millisecond that reads wrong (an MLP at one row, float32, 2-core
        Zen 4: the served form 0.46-0.94x the model as given, where steady streams read 1.09x; thirty-fifth
        session). A served form timed within ``SHAPE_CLOSE`` of the model as given, or not timed against it,
        is timed again in blocks at this signature's ``SHAPE_RECHECK``-th call (``_slower_than_given``)."""
        if self._opts["verify"] != "shapes" or self._served.kind == "original":
            return
        own = dtype_name(model_dtype(self.kiln_original))
        given = [m.median_ms for m in measures.values() if m.kind == "eager" and m.dtype == own and m.median_ms]
        served = measures[self._served.name].median_ms
        if given and served and served * SHAPE_CLOSE <= min(given):
            return
        self._recheck[inputs.signature(args, kwargs)] = SHAPE_RECHECK

    def _find(self, name: str) -> Candidate:
        return next(c for c in self._cands if c.name == name)

    def _install(self, name: str, fn, order: list[str]) -> None:
        cand = self._find(name)
        report = self.kiln_report
        rest = [c.name for c in self._cands if c.name not in order]
        object.__setattr__(self, "_order", order + rest)
        object.__setattr__(self, "_served", cand)
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_choice", name)
        self._recheck.clear()  # its readings were of the form served before
        report.active = name
        report.dtype_served = cand.dtype
        report.applied = applied_for(cand)
        for m in report.candidates:
            if m.status == "served":
                m.status = "passed"
            if m.name == name:
                m.status = "served"

    def _after_select(self, v, measures) -> None:
        report = self.kiln_report
        served = self._served
        if v is not None:
            report.guard = v.to_dict()
            worst = max(range(len(v.errors)), key=lambda i: v.errors[i].rel / max(v.tolerances[i], 1e-30))
            report.error, report.tolerance = v.errors[worst].to_dict(), v.tolerances[worst]
        else:
            report.guard = {"ok": None, "outputs": [], "note": "unverified: " + (
                "verify='off'" if self._opts["verify"] == "off" else "no untouched reference (inplace=True)")}
        ms = {m.name: m for m in measures.values() if m.median_ms is not None}
        me = ms.get(served.name)
        if me is not None:
            eager = [m.median_ms for m in ms.values() if m.kind == "eager"]
            stocks = [m.median_ms for m in ms.values() if m.kind == "stock"]
            if eager:
                report.speedup["vs_eager"] = round(min(eager) / me.median_ms, 3)
            if stocks:
                report.speedup["vs_stock"] = round(min(stocks) / me.median_ms, 3)
        if served.kind != "torchkiln":
            what = {"eager": "the model as given (eager) was fastest", "stock": "the stock torch.compile recipe "
                    "was fastest"}.get(served.kind, "")
            if served.dtype != self.kiln_recipe.dtype:
                what = f"no {self.kiln_recipe.dtype} candidate beat the model as given in {served.dtype}"
            warn_once("served", f"torchkiln: nothing of torchkiln's own beat the alternatives here; "
                      f"serving {served.name!r} ({what}). See tk.report(model).", owner=self)
        elif served.tier > 0:
            warn_once("served", f"torchkiln: no {self.kiln_recipe.dtype} candidate passed the numeric "
                      f"guard; serving {served.name!r}. See tk.report(model).", owner=self)
        # the float32 copy of a half model (candidates.upcast_wins); an int8 candidate's dtype ("int8-static") is not
        # one (this fired on every int8 quantization of a float32 model: a new-user probe, fiftieth session)
        elif served.dtype == "float32" and self.kiln_recipe.dtype in ("bfloat16", "float16"):
            warn_once("upcast", f"torchkiln: the model's {self.kiln_recipe.dtype} weights run as a float32 copy "
                      f"({served.name}), faster here than {self.kiln_recipe.dtype}, which this CPU only emulates: "
                      "twice the weights' memory; outputs stay in the model's dtype. See tk.report(model).", owner=self)

    def _serve_original(self, args, kwargs, ref, reason: str):
        cand = next((c for c in self._cands if c.kind == "original"), None)
        if cand is None:  # inplace=True: the last torchkiln step stays, loudly
            cand = next(c for c in self._cands if "eager passes" in c.name)
            warn_once("noguard", f"torchkiln: {reason}, and with inplace=True there is no untouched "
                      "model to fall back to: serving the eager passes anyway. Use inplace=False.", owner=self)
        fn = cand.make()
        self.kiln_report.fallbacks.append(Fallback("every candidate", cand.name, reason))
        warn_once("orig", f"torchkiln: {reason}; serving {cand.name!r}. See tk.report(model).", owner=self)
        self._install(cand.name, fn, [cand.name])
        self._mark_verified(args, kwargs)
        return self._for_real(fn, args, kwargs)

    # ----------------------------------------------------- later: verify / step down
    def _verify_shape(self, args, kwargs):
        sig = inputs.signature(args, kwargs)
        if sig in self._shapes and self._recheck.pop(sig, None) is not None:
            slower = self._slower_than_given(args, kwargs, again=True)
            if slower is not None:
                return self._detour(args, kwargs, *slower, failed=False)
        if sig in self._shapes or len(self._shapes) >= VERIFIED_SHAPES:
            return self._serve(self._fn, args, kwargs)
        ref = self._reference(args, kwargs)  # raises for inputs the model itself rejects
        slower = self._slower_than_given(args, kwargs) if ref is not None else None
        if slower is not None:
            return self._detour(args, kwargs, *slower, failed=False)
        try:
            out = self._for_real(self._fn, args, kwargs)
        except Exception as e:
            if is_oom(e) or self._served.kind == "original":
                raise
            return self._step_down(args, kwargs, f"{type(e).__name__}: {first_line(e)}", ref, detour=True,
                                   until=self._transient(e, args, kwargs))
        if ref is not None and self._served.kind != "original":
            v = verdict(out, ref, self._tols or tolerances(DTYPES[self.kiln_recipe.dtype], None, 1))
            if not v.ok:
                return self._step_down(args, kwargs, f"output differs from the original on new input shapes: {v}",
                                       ref)
        self._mark_verified(args, kwargs)
        return out

    def _slower_than_given(self, args, kwargs, again: bool = False) -> tuple[str, Candidate, object] | None:
        """At a new input signature, the served form timed against the model as given on these inputs,
        in interleaved blocks (``timing.blocks``, ``SHAPE_BUDGET``): the selection timed the candidates at the first signature only,
        and a form faster there can be slower here (an MLP whose oneDNN linears were packed for 64 rows
        ran 0.79 ms a call at one row against eager's 0.57, on a 2-core Zen 4; RESULTS.md, thirty-third
        session). Returns (reason, the model as given, its callable) when that is faster by more than
        ``SHAPE_MARGIN``, else None; each measurement goes into the report's ``shapes``. A close first
        reading that kept the served form is taken again (``again``) at the signature's ``SHAPE_RECHECK``-th
        call, warm."""
        served = self._served
        given = next((c for c in self._cands if c.kind == "original"), None)
        if given is None or served.kind == "original" or (served.kind == "eager" and served.dtype == given.dtype):
            return None
        dev = torch.device(self.kiln_recipe.device)
        given_fn = given.make()
        self._restore()
        wrap = self._snap is not None and self._snap.changed  # a model that writes its state: put back each time
        calls = {}
        for name, fn, graphs in (("served", self._fn, served.copy_outputs), ("given", given_fn, False)):
            call = (lambda fn=fn: inputs.clone(fn(*args, **kwargs))) if graphs else (lambda fn=fn: fn(*args, **kwargs))
            if name == "served" and not served.live_weights:  # what each of its calls pays besides: the weight check
                call = _after(self._watch.changed, call)
            calls[name] = _after(self._restore, call) if wrap else call
        try:
            with torch.no_grad():
                for _ in range(3 if dev.type == "cuda" else 1):  # compiles for the new shapes; graph recording
                    for call in calls.values():
                        call()
                times = blocks(calls, dev, min(SHAPE_BUDGET, self._opts["time_budget"]))
        except Exception as e:
            if is_oom(e):
                raise
            return None  # the call below meets the failure, and steps down as usual
        finally:
            self._restore()
        s, g = (round(statistics.median(times[n]) * 1e3, 4) for n in ("served", "given"))
        slower = s > g * SHAPE_MARGIN
        entry = {"inputs": [list(s) for s in inputs.shapes(args, kwargs)], "served_ms": s, "given_ms": g,
                 "serves": given.name if slower else served.name}
        if again:
            entry["after_calls"] = SHAPE_RECHECK
        elif not slower and s * SHAPE_CLOSE > g:
            self._recheck[inputs.signature(args, kwargs)] = SHAPE_RECHECK
        self.kiln_report.shapes.append(entry)
        if not slower:
            return None
        when = f"after {SHAPE_RECHECK} calls of them" if again else "at their first call"
        return (f"at these input shapes the model as given ran {g:.3f} ms a call against {s:.3f} ms "
                f"(timed {when})", given, given_fn)

    def _step_down(self, args, kwargs, reason: str, ref=None, detour: bool = False, until=None):
        """Walk the measured order below the served candidate; a step is taken only if
        it runs these inputs and passes the guard. The original ends the walk.

        ``detour``: the served candidate failed on a call form it never answered (another flag, an
        output option): the step serves that form only, and the rest stay where they were. One
        ``output_hidden_states=True`` call used to leave every later call on the eager passes.
        ``until``: the failure's cause is transient (see Detour)."""
        if ref is None:
            ref = self._reference(args, kwargs)  # user errors raise here, unchanged
        here = self._served.name
        step = self._next_step(args, kwargs, ref)
        if detour and len(self._detours) < MAX_DETOURS:
            original = next((c for c in self._cands if c.kind == "original"), None)
            if step is None and original is not None:
                step = (original, original.make())
            if step is not None:
                return self._detour(args, kwargs, reason, *step, until=until)
        if step is None:
            return self._serve_original(args, kwargs, ref, f"{here} failed ({reason})")
        cand, fn = step
        self.kiln_report.fallbacks.append(Fallback(here, cand.name, reason))
        warn_once(f"fb:{here}", f"torchkiln: {here} -> {cand.name}: {reason}", owner=self)
        self._install(cand.name, fn, self._order)
        self._mark_verified(args, kwargs)
        return self._for_real(fn, args, kwargs)

    def _next_step(self, args, kwargs, ref) -> tuple[Candidate, object] | None:
        """The first candidate below the served one, in measured order and short of the original,
        that runs these inputs and passes the guard, with its callable."""
        here = self._served.name
        below = self._order[self._order.index(here) + 1:] if here in self._order else []
        measures = {m.name: m for m in self.kiln_report.candidates}
        for name in below:
            cand = self._find(name)
            if cand.kind == "original":
                break
            fn, out, why = self._try(cand, args, kwargs, measures)
            if fn is None:
                continue
            if ref is not None and self._tols is not None and not verdict(out, ref, self._tols).ok:
                continue
            return cand, fn
        return None

    def _detour(self, args, kwargs, reason: str, cand: Candidate, fn, failed: bool = True, until=None):
        """Serve this call form with ``cand`` from now on (or while ``until()``); the served candidate
        stays for the rest. ``failed=False``: not a failure, ``cand`` is faster on it (_slower_than_given)."""
        here = self._served.name
        # the detour is keyed on the whole signature, shapes included: named by its flags alone, two shapes'
        # detours read as one for every call with return_dict=True (a new-user probe, fifty-first session)
        form = inputs.describe(args, kwargs)
        self.kiln_report.fallbacks.append(Fallback(here, cand.name, f"for calls with {form} only: {reason}"))
        warn_once(f"detour:{here}:{form}", f"torchkiln: calls with {form} go to {cand.name} ({here} "
                  f"{'failed' if failed else 'was slower'} on them: {reason}); other calls stay on {here}", owner=self)
        self._detours[inputs.signature(args, kwargs)] = Detour(cand, fn, until, form)
        self._restore()
        return self._serve(fn, args, kwargs, cand)

    def _transient(self, e: BaseException, args, kwargs) -> Callable[[], bool] | None:
        """How long a failure's detour lasts: a compile past its deadline, until it ends, once per call
        form (a compile that ran past its deadline and then failed would otherwise cost every retry the
        deadline); anything else, for good."""
        if isinstance(e, CompileTimeout) and inputs.signature(args, kwargs) not in self._undetoured:
            return compiling_late
        return None

    def _end_detour(self, sig, detour: Detour) -> None:
        with self._lock:
            self._undetoured.add(sig)
            if self._detours.pop(sig, None) is detour:
                here = self._served.name
                self.kiln_report.fallbacks.append(Fallback(detour.cand.name, here, (
                    f"for calls with {detour.form} only: what sent them to {detour.cand.name} has passed "
                    f"(the compile that ran past its deadline ended); back on {here}")))

    # ------------------------------------------------------- the original's face
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads into the original; the next call (now, with a sample_input) rebuilds and re-verifies."""
        with self._lock:
            result = self.kiln_original.load_state_dict(state_dict, strict=strict, assign=assign)
            if self._fn is not None:
                self._reset(choice=self.kiln_report.active)
        if self._sample is not None:
            self(*self._sample[0], **self._sample[1])
        return result

    def train(self, mode: bool = True):
        """``nn.Module.train``'s contract, on the original: a parent model's ``.train()`` reaches here (a
        frozen optimized backbone inside a model being fine-tuned, a Lightning or HF Trainer loop), and
        raising broke that loop where eager runs. In training mode calls run the original itself (dropout
        and batch statistics as eager), said once; ``.eval()`` serves the fast form again. Training it
        fast is ``tk.optimize(model, optimizer=opt)``'s job."""
        self.kiln_original.train(mode)
        object.__setattr__(self, "training", bool(mode))
        if mode:
            object.__setattr__(self, "_own", "training")  # forward's first check; cleared back in eval mode
        return self

    def _attr(self, name: str, attr):
        if name == "generate" and callable(attr):
            # a tk.quantize'd model keeps its own generate: tk.llm quantizes its own decoder (llm.optimize's quant=)
            if is_causal_lm(self.kiln_original) and getattr(self.kiln_original, "kiln_quant", None) is None:
                return functools.partial(self._fast_generate, attr)
            return _unoptimized(attr, name)
        return attr

    def _fast_generate(self, own, *args, **kwargs):
        """A causal LM's generate() on tk.llm's fast decoder (the forward, which generate would call one
        token at a time, is what the candidates serve). Built on first use over the original's weights in
        the served dtype, and again when those weights change (the same version check as a call). If it
        cannot be built, the original's own generate (``own``) runs, as it did before optimize."""
        with self._lock:
            built = self._llm
            if built is None or built[1].changed():
                watch = WeightWatch(self.kiln_original)
                watch.remember(native=False)  # checked once per generate() call: not worth a compile
                from .llm import optimize as llm_optimize

                r = self.kiln_recipe
                try:
                    fast = llm_optimize(self.kiln_original, dtype=parse_dtype(r.dtype), device=r.device,
                                        compile=r.compile)
                except Exception as e:  # noqa: BLE001 - never fail where the model's own generate works
                    why = f"{type(e).__name__}: {first_line(e)}"
                    self.kiln_report.fallbacks.append(Fallback("generate: tk.llm fast decoder", "the model's own "
                                                               "generate", why))
                    fast = None
                object.__setattr__(self, "_llm", (fast, watch))
                if built is None and fast is not None:
                    self.kiln_report.applied.append(f"generate: tk.llm {fast.kiln_report.path} path "
                                                    f"({fast.kiln_report.dtype}; kiln_llm_report has its report)")
            fast = self._llm[0]
        if fast is None:
            return _unoptimized(own, "generate")(*args, **kwargs)
        return fast.generate(*args, **kwargs)

    @property
    def kiln_llm_report(self):
        """The tk.llm report of generate()'s fast decoder (None until generate() first runs)."""
        return self._llm[0].kiln_report if self._llm and self._llm[0] is not None else None

    def extra_repr(self) -> str:
        return f"device={self.kiln_recipe.device}, dtype={self.kiln_recipe.dtype}, active={self.kiln_report.active!r}"


class Detour(NamedTuple):
    """A call form served by another candidate than the served one, while ``until()`` (None: for good).
    A compile past its deadline (CompileTimeout) is transient: torch's compile goes on in the background,
    and once it has ended the form's next call compiles from dynamo's cache and is verified as a new one."""

    cand: Candidate
    fn: object
    until: Callable[[], bool] | None
    form: str


_FAILED = object()  # _rebuild's "no": a full selection follows
_RACED = object()  # _refresh's "another thread set up first": serve with what it built


def _unoptimized(method, name: str):
    def call(*args, **kwargs):
        warn_once(f"unopt:{name}", f"torchkiln: {name}() runs the original model's forward, unoptimized (its "
                  "step-by-step cache calls need the LLM path). Calls of the model itself are optimized.")
        return method(*args, **kwargs)
    return call


def _check_positional(optimizer, level) -> str:
    """ipex.optimize's positional order (``model, dtype, optimizer, level``) is this one's: an IPEX
    call such as ``ipex.optimize(model, torch.bfloat16, opt)`` read ``opt`` as the level before. Also
    what a call written for that old order (``optimize(model, dtype, "O2")``) now passes."""
    if isinstance(optimizer, str) and optimizer.upper() in LEVELS:
        raise TypeError(f"optimizer={optimizer!r}: the third positional argument is the optimizer, as in "
                        f"ipex.optimize(model, dtype, optimizer, level, inplace); pass level={optimizer!r} by keyword")
    if not isinstance(level, str):
        raise TypeError(f"level={type(level).__name__} is not a level: the fourth positional argument is level "
                        "('O0', 'O1', 'O2'), as in ipex.optimize; pass sample_input= and the others by keyword")
    return level.upper()  # "o1" as "O1"


@quiet_deprecations()  # torch's notices from what it runs are not the caller's (_log.py)
def optimize(model, dtype=None, optimizer=None, level: str = "O1", inplace: bool = False, *, sample_input=None,
             device=None, verify: str = "shapes", candidates: str = "auto", time_budget: float = 2.0,
             quantize=None, calib_data=None, eval_data=None, progress: bool | None = None, **knobs):
    """Plan and apply the fastest verified recipe for ``model`` on this machine.

    Accepts every ``ipex.optimize`` keyword, and its first five arguments in its order
    (``model, dtype, optimizer, level, inplace``). Returns an ``nn.Module`` (with
    ``optimizer``: the tuple ``(model, optimizer)``, as IPEX does). ``quantize``: a
    tk.quantize scheme, applied first (with ``calib_data``; ``eval_data`` for its accuracy report), then compiled and verified
    against the eager quantized model; a model tk.quantize returned is served the same way.
    ``progress``: True shows a bar (stderr) while ``sample_input``'s candidates are built and
    verified, and tk.quantize's calibration bar; False hides both; None (default) keeps tk.quantize's.
    """
    _log.configure()
    t0 = time.perf_counter()
    _validate_model(model)
    level = _check_positional(optimizer, level)
    if isinstance(model, KilnModule) and optimizer is None:
        warn_once("already", "torchkiln: model is already optimized; returned unchanged. "
                  "To re-plan, call tk.optimize(model.kiln_original, ...)")
        return (model, optimizer) if optimizer is not None else model
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise TypeError(f"optimize() got unknown keyword(s) {sorted(unknown)}; valid knobs: {sorted(KNOBS)}")
    for k in INTEL_ONLY:
        if k in knobs:
            warn_once(f"intel:{k}", f"torchkiln: {k} is an Intel-IPEX-only knob with no vendor-neutral "
                      "meaning; accepted and ignored")
    for k in ("split_master_weight_for_bf16", "cpu_allocator"):
        if optimizer is None and k in knobs:
            warn_once(f"{k}-inference", f"torchkiln: {k} applies to training (with optimizer=); ignored for "
                      "inference")
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is not one of 'O0' (nothing), 'O1' (safe default), 'O2' (aggressive)")
    if verify not in VERIFY:
        raise ValueError(f"verify={verify!r} is not one of {VERIFY}: 'shapes' checks the first {VERIFIED_SHAPES} "
                         "input shapes against the original, 'first' only the first call, 'off' none")
    if progress not in (None, True, False):
        raise ValueError(f"progress={progress!r} must be True, False or None (the default)")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace={inplace!r} must be True or False")
    if not isinstance(time_budget, (int, float)) or time_budget < 0:
        raise ValueError(f"time_budget={time_budget!r} must be a number of seconds >= 0 (default 2.0)")
    if optimizer is not None:
        given_inference = {k: v for k, v in (("quantize", quantize), ("calib_data", calib_data),
                                             ("eval_data", eval_data)) if v is not None}
        if candidates != "auto":
            given_inference["candidates"] = candidates
        if given_inference:  # ignored silently, they read as applied (a new-user probe, thirty-seventh session)
            raise ValueError(f"{', '.join(f'{k}=' for k in given_inference)} serve inference and cannot be used "
                             "with optimizer= (training); for a quantized model to serve, train first, then "
                             "tk.optimize(model.eval(), quantize=...), or quantize-aware training outside torchkiln")
        from .training import optimize_training

        return optimize_training(model, optimizer, dtype, level, sample_input, device, verify, time_budget, knobs)
    if candidates not in SCOPES:
        raise ValueError(f"candidates={candidates!r} is not one of {SCOPES}: 'auto' times torchkiln's recipe "
                         "against eager and the stock torch.compile recipe, 'torchkiln' only its own")
    training = training_module(model)
    if training is not None:
        where = "the model" if training == "" else f"submodule {training!r}"
        raise ValueError(f"{where} is in training mode and no optimizer was given. For inference call "
                         "model.eval() before tk.optimize(model, ...); for training pass the optimizer: "
                         "tk.optimize(model, optimizer=opt, ...)")
    compute = parse_dtype(dtype)
    own = model_dtype(model)
    if compute == torch.float32 and own in (torch.bfloat16, torch.float16) and quantize is None:
        # ipex.optimize's dtype=float32 means "no low-precision conversion": a bf16/fp16 model (a
        # checkpoint loaded in bf16) is served at its own precision, with that precision's guard.
        # Planned as float32, every compiled candidate failed float32's 1e-4 and eager served.
        if dtype is not None:
            warn_once(f"own-dtype:{own}", f"torchkiln: the model's parameters are {dtype_name(own)}; dtype=float32 "
                      f"does not upcast them: planned and answered in {dtype_name(own)} (call model.float() first for "
                      "a float32 model)")
        compute = own
    hw = detect()
    target = resolve_device(device if device is not None else model_device(model), hw)
    if quantize is None and sample_input is None and is_causal_lm(model):
        from .llm import optimize as llm_optimize

        # a decoder's generate() is what users run; its forward stays the model's own (in dtype).
        # With a sample_input the forward is the workload: it is planned like any model below, and
        # generate() goes to the same fast decoder (KilnModule._fast_generate).
        return llm_optimize(model, dtype=compute if dtype is not None else own, device=target,
                            compile=knobs.get("graph_mode") is not False, inplace=inplace)
    given = model  # the float model, for quantize='s speed check
    if quantize is not None:
        from .quantization import quantize as _quantize

        more = {} if progress is None else {"progress": progress}
        model = _quantize(model, quantize, calib_data=calib_data, sample_input=sample_input, eval_data=eval_data,
                          device=target, **more)
    elif calib_data is not None or eval_data is not None:
        what = "calib_data" if calib_data is not None else "eval_data"
        raise ValueError(f"{what}= is only used with quantize= (e.g. quantize='int8-static'); "
                         f"without it, remove {what}")
    sample = snap = None
    if sample_input is not None:
        sample = inputs.to(inputs.normalize(sample_input), target)
        snap = Pristine(model, *sample)  # the sample runs are optimize's, not the caller's: no trace left
        _check_sample(model, sample)
    quant = getattr(model, "kiln_quant", None)
    upcast = None
    if quant is not None:
        from .passes.global_avg_pool import has_avg_pool
        from .quantization.plan import has_conv as quant_has_conv
        from .quantization.plan import linear_shapes
        from .quantization.plan import plan as plan_quantized

        if compute != torch.float32:
            warn_once("quant-dtype", f"torchkiln: dtype={dtype_name(compute)} is ignored for a quantized model; "
                      "it is served at the precision it was quantized in (cast the model before tk.quantize)")
        recipe = serving_knobs(plan_quantized(quant, str(target), level, hw.cpu.bf16_native, quant_has_conv(model),
                                              linear_shapes(model), has_avg_pool(model)), knobs)
        unused = sorted(k for k, v in knobs.items() if v is not None and k not in SERVING_KNOBS + INTEL_ONLY)
        if unused:
            warn_once(f"quant-knobs:{unused}", f"torchkiln: {', '.join(unused)} ignored for a quantized model: its "
                      f"graph has no modules to transform; {', '.join(SERVING_KNOBS)} apply")
    else:
        shape = {"batch": inputs.batch_size(sample) if sample else None, "rows": inputs.rows(sample) if sample else None}
        recipe = plan(model, hw, str(target), compute, level, knobs, **shape)
        if recipe.dtype != dtype_name(compute):
            warn_once(f"dtype:{compute}:{target}", "torchkiln: " + recipe.notes[0])
        if upcast_wins(model, recipe, inplace):
            upcast = plan(model, hw, str(target), torch.float32, level, knobs, **shape)
    report = Report(recipe=recipe.to_dict(), quantization=quant.report.to_dict() if quant is not None else None)
    sample_ref = None
    if inplace and sample is not None and verify != "off":
        # The untouched model's answer, before the passes change it in place.
        args, kwargs = inputs.to(sample, model_device(model))
        with torch.no_grad():
            sample_ref = model(*args, **kwargs)
    kiln = KilnModule(model, recipe, report, sample, inplace, verify, candidates, float(time_budget), sample_ref,
                      upcast)
    if sample is not None:
        steps = sum(1 for c in kiln._cands if c.kind != "original")
        with ticks(bool(progress), "building candidates", steps) as tick:
            object.__setattr__(kiln, "_tick", tick)
            try:
                kiln(*sample[0], **sample[1])  # compile, verify and time now, not on the user's first request
            finally:
                object.__setattr__(kiln, "_tick", None)
                snap.restore()
                kiln._remember_weights()
        if given is not model and kiln._fn is not None:
            _against_float(kiln, given, sample)
    report.optimize_seconds = round(time.perf_counter() - t0, 3)
    log.info("%s", report)
    return kiln


def _against_float(kiln: KilnModule, given: nn.Module, sample: inputs.Args) -> None:
    """quantize= on a float model: time the served quantized model against that float model as
    given (eager, the calls it would have made), and warn when quantizing made it slower. fp8 on
    bert-base at batch 64 on an H200: the per-row activation scaling costs more than the fp8 GEMMs
    save, 0.37x torchkiln bf16 (RESULTS.md, twenty-sixth and twenty-seventh sessions)."""
    dev = torch.device(kiln.kiln_recipe.device)
    if model_device(given) != dev:
        return
    args, kwargs = sample
    snap = Pristine(given, args, kwargs)
    fns = {"float": _after(snap.restore, lambda: given(*args, **kwargs)),
           "served": lambda: kiln(*args, **kwargs)}
    try:
        with torch.no_grad():
            for f in fns.values():
                f()
            times = interleaved(fns, dev, min(1.0, kiln._opts["time_budget"]))
    finally:
        snap.restore()
    if len(times["float"]) < 3 or len(times["served"]) < 3:
        return
    served, floating = statistics.median(times["served"]), statistics.median(times["float"])
    ratio = floating / served
    kiln.kiln_report.speedup["vs_float_model_as_given"] = round(ratio, 3)
    if ratio < SLOWER:
        scheme = (kiln.kiln_report.quantization or {}).get("scheme", "this scheme")
        warn_once(f"quant-slower:{scheme}:{dev.type}",
                  f"torchkiln: the {scheme}-quantized model ({served * 1e3:.3g} ms a call) is slower than the float "
                  f"model as given ({floating * 1e3:.3g} ms) on these inputs: quantizing saves memory here, not time. "
                  "Serve the float model through tk.optimize(model, dtype=...) if speed is the goal", owner=kiln)


def report(model: nn.Module) -> Report:
    """The report of an optimized model (also ``model.kiln_report``)."""
    from .training import TrainModule

    if not isinstance(model, (KilnModule, TrainModule)):
        raise TypeError(f"report() expects a model returned by tk.optimize(), got {type(model).__name__}")
    return model.kiln_report


def refresh(model: nn.Module) -> None:
    """Rebuild what serves an optimized model from its original's weights, on its next call. Changes
    PyTorch records (in-place ops, ``load_state_dict``, ``p.data = t``, a new parameter) are noticed
    without this; writes through ``p.data`` (``p.data.copy_(t)``) are not: call this after them."""
    if not isinstance(model, KilnModule):
        raise TypeError(f"refresh() expects a model returned by tk.optimize() for inference, got "
                        f"{type(model).__name__} (a training model reads its parameters directly and needs no refresh)")
    model.kiln_refresh()


def _is_graph_break(e: BaseException) -> bool:
    unsupported = getattr(getattr(torch, "_dynamo", None), "exc", None)
    return unsupported is not None and isinstance(e, unsupported.Unsupported)


def _validate_model(model) -> None:
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("optimize() got a TorchScript module; torchkiln works on the eager nn.Module "
                        "(TorchScript is deprecated upstream). Pass the model before torch.jit.script/trace.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() expects a torch.nn.Module, got {type(model).__name__}")


def _check_sample(model: nn.Module, sample: inputs.Args) -> None:
    args, kwargs = inputs.to(sample, model_device(model))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:
        raise ValueError(f"sample_input was rejected by the model itself ({type(e).__name__}: {e}); "
                         "pass the tensor, tuple of positional args, or dict of kwargs its forward() takes") from e


def _after(first, fn):
    def call():
        first()
        return fn()
    return call


def _float32_truth(model: nn.Module, args, kwargs):
    """A half-precision model's output in float32 (a copy of the model, dropped after the call):
    the guard's reference. Its own output carries bf16's rounding, so a compiled candidate that
    rounds differently (fp32 intermediates in fused kernels) differed from it by ~1% with a
    tolerance of 1e-3 (the plain cast is the model itself: no baseline error), and eager always
    served (bert-base in bf16: 1.00x). Against float32 the model as given sets the baseline as the
    plain cast does for a float32 model. None where the copy does not fit or cannot run in float32."""
    a, k = inputs.to((args, kwargs), dtype=torch.float32)
    try:
        return copy.deepcopy(model).float()(*a, **k)
    except Exception as e:  # noqa: BLE001 (an OOM or a model that mixes dtypes: its own output then)
        log.info("torchkiln: no float32 reference for this %s model (%s)", model_dtype(model), first_line(e))
        return None
