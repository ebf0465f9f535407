"""TrainModule: the model tk.optimize returns for training. Its parameters, buffers
and state_dict are the original's (the optimizer, a scheduler, a checkpoint see
the very tensors the user built); calls run the fastest verified candidate.

Candidates: the model eager (under autocast for bf16/fp16) and the same compiled
(forward and backward, through torch.compile). At the first training call (or at
``sample_input``) both take one step from the same state; the compiled step must
match eager's outputs and every gradient within the guard's tolerance (relative to
what autocast itself costs, as for inference), and then they are timed; the
faster one serves. A failure of the compiled step later steps down to eager on
the same inputs (an out-of-memory error is re-raised). Under DDP the compiled step is
compiled as one graph (``OneGraph``: why, and the measurements, there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import statistics
import sys
import threading
import time

import torch
from torch import nn

from .. import inputs
from .._log import quiet_deprecations, warn_once
from ..face import OriginalFace
from ..guard import BASELINE_FACTOR, Verdict, compare_each, tf32_allowed, tolerances
from ..modelutil import DTYPES, dtype_name, first_line, has_conv, is_oom, model_dtype
from ..passes import registry
from ..passes.compile import Fresh, patches_per_thread
from ..passes.full_mask import FullMaskPass
from ..passes.hash_dropout import HashDropoutPass
from ..report import Fallback, Measurement, Report
from ..runtime import allocator
from ..timing import interleaved
from . import probe
from .graphs import GraphedStep
from .recipe import TrainRecipe

log = logging.getLogger(__name__)
_LABELS = {"eager": "eager", "compiled": "compiled forward+backward",
           "graphs": "compiled forward+backward under CUDA graphs"}
_ids = itertools.count()  # warn-once keys per model (id() values are reused)


class AutocastStep(nn.Module):
    """The model under autocast, outputs back in the inputs' float dtype (float32 for token ids): a loss
    computed outside autocast then sees float32 as before. A model that computes its own loss
    (transformers with labels: ``out.loss`` set, float32 as transformers computes it) keeps its outputs
    as autocast made them, as under stock autocast: the loop uses that loss, and casting the logits
    back wrote a float32 copy of them each step (1.6 GB for GPT-2-medium at bs16 seq512). Measured
    against the stock recipe: H200 GPT-2-medium 0.99x before, 1.00x after; bert-base on an AMX CPU
    0.94-0.98x before, 0.95x after (within that machine's spread; benchmarks/RESULTS.md)."""

    def __init__(self, model: nn.Module, device_type: str, dtype: torch.dtype | None):
        super().__init__()
        self.model, self.device_type, self.dtype = model, device_type, dtype

    def forward(self, *args, **kwargs):
        if self.dtype is None:
            return self.model(*args, **kwargs)
        out_dtype = next((t.dtype for t in inputs.flatten((args, kwargs)) if t.is_floating_point()), torch.float32)
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.model(*args, **kwargs)
        if isinstance(getattr(out, "loss", None), torch.Tensor):
            return out
        return inputs.tree_map(lambda t: t.to(out_dtype) if t.is_floating_point() else t, out)


class InputsRejected(Exception):
    """The float32 eager step itself failed on a setup call's inputs: the caller's error."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class TrainModule(OriginalFace):
    def __init__(self, original: nn.Module, recipe: TrainRecipe, report: Report, verify: str, time_budget: float,
                 split=None):
        super().__init__()
        s = object.__setattr__
        s(self, "_split", split)  # SplitWeights (split.py) or None
        s(self, "kiln_original", original)
        s(self, "kiln_recipe", recipe)
        s(self, "kiln_report", report)
        s(self, "_opts", {"verify": verify, "time_budget": time_budget})
        s(self, "_lock", threading.Lock())
        s(self, "_uid", next(_ids))
        self._show_signature()  # HF Trainer picks the columns it passes by forward's parameters
        self._build()
        self.training = original.training

    def _build(self) -> None:
        rec = self.kiln_recipe
        low = DTYPES[rec.dtype] if rec.precision == "autocast" else None
        s = object.__setattr__
        s(self, "_device", torch.device(rec.device))
        s(self, "_eager", AutocastStep(self.kiln_original, self._device.type, low))
        s(self, "_graph_pass", registry.graph_pass(rec.passes))
        opts = {"pre_grad_custom_pass": self._graph_pass} if self._graph_pass is not None else None
        compiled = _compile(Fresh(self._eager), opts) if rec.compile else None
        if compiled is not None:  # one dynamo patch per call: under DDP it also holds optimize_ddp
            compiled = OneGraph(compiled) if _under_ddp(self.kiln_original) else Traced(compiled)
        graphs = None
        if compiled is not None and rec.graphs:
            replayed = Traced(_compile(Fresh(self._eager), {**(opts or {}), "triton.cudagraphs": True}))
            graphs = GraphedStep(replayed, probe.trainable(self.kiln_original))
        s(self, "_compiled", compiled)
        s(self, "_graphs", graphs)
        s(self, "_fn", None)
        s(self, "_served", "eager")
        s(self, "_passed", ("eager",))

    def __getstate__(self):
        recipe, masters = self.kiln_recipe, None
        if self._split is not None and self._split.active:
            # A copy (pickle, deepcopy) has no split step to hold trails: it gets the exact float32 masters,
            # written into its own parameters by __setstate__. The model itself goes into the state as it is,
            # so a copy made with its optimizer (deepcopy((model, opt)), torch.save({"model": ..., "opt":
            # ...})) shares the copier's memo: the copied optimizer holds the copied model's parameters.
            # (A deepcopy of the masters' model here had a memo of its own, and the copied optimizer then
            # trained parameters the copied model did not hold; a new-user probe, fiftieth session.)
            index = {id(p): i for i, p in enumerate(self._split.params)}
            masters = {name: self._split.master(index[id(p)]) for name, p in self.kiln_original.named_parameters()
                       if id(p) in index}
            recipe = dataclasses.replace(recipe, master_weights="fp32")
        return {"original": self.kiln_original, "recipe": recipe, "report": self.kiln_report,
                "opts": self._opts, "training": self.training, "masters": masters}

    def __setstate__(self, state):
        nn.Module.__init__(self)
        s = object.__setattr__
        s(self, "_split", None)
        if state.get("masters"):
            params = dict(state["original"].named_parameters())
            with torch.no_grad():
                for name, master in state["masters"].items():
                    params[name].data = master  # the same Parameter object, its exact float32 value
        for k, v in (("kiln_original", state["original"]), ("kiln_recipe", state["recipe"]),
                     ("kiln_report", state["report"]), ("_opts", state["opts"]), ("_lock", threading.Lock()),
                     ("_uid", next(_ids))):
            s(self, k, v)
        self._show_signature()
        self._build()
        self.training = state["training"]

    def state_dict(self, *args, **kwargs):
        sd = self.kiln_original.state_dict(*args, **kwargs)
        if self._split is None or not self._split.active:
            return sd
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        index = {id(p): i for i, p in enumerate(self._split.params)}
        for name, p in self.kiln_original.named_parameters(remove_duplicate=False):
            key = prefix + name
            if id(p) in index and key in sd:  # the exact float32 master, never the bf16 half
                sd[key] = self._split.master(index[id(p)])
        return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self._split is None or not self._split.active:
            return self.kiln_original.load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the split weights' tensors; load with "
                             "assign=False (the default), or optimize without split_master_weight_for_bf16")
        with self._split.masters():  # float32 values land in float32 masters, then split again
            return self.kiln_original.load_state_dict(state_dict, strict=strict)

    def _attr(self, name: str, attr):
        if name == "save_pretrained" and callable(attr) and self._split is not None:
            # transformers writes the original's state_dict: with split weights, the bf16 halves (3.8e-3 off the
            # masters, and a bf16 config; a new-user probe, fifty-first session). The exact float32 masters
            # are put in place while it writes, as state_dict() returns them.
            split = self._split

            @functools.wraps(attr)
            def save_pretrained(*args, **kwargs):
                with split.masters() if split.active else contextlib.nullcontext():
                    return attr(*args, **kwargs)
            return save_pretrained
        return attr

    def train(self, mode: bool = True):
        self.kiln_original.train(mode)
        self.training = mode
        return self

    # ------------------------------------------------------------------ calls
    def forward(self, *args, **kwargs):
        device, low = self._device.type, self._eager.dtype
        if low is not None and torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == low:
            # IPEX's training recipe calls the model under torch.cpu.amp.autocast(): the step applies that
            # autocast itself, and with the caller's on as well torch.compile compiled it a second time (a
            # recompile stall, a graph never verified) when calls with and without it mixed. Another dtype
            # is the caller's own mixed precision, left to autocast and torch.compile as stock.
            with torch.autocast(device, enabled=False):
                return self._again(*args, **kwargs)
        if self._fn is None and self._compiled is not None and self.kiln_original.training \
                and torch.is_grad_enabled():
            with self._lock:
                if self._fn is None:
                    with quiet_deprecations():  # compiled in this first call (_log.py says why)
                        self._setup(args, kwargs)
        while True:
            fn = self._fn if self._fn is not None else self._eager
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if is_oom(e):
                    raise
                if fn is self._eager:
                    if self._split is None:
                        raise
                    return self._unsplit(e, args, kwargs)
                self._step_down(e)

    def _step_down(self, error: Exception) -> None:
        """One level down: CUDA graphs to the plain compiled step (where it passed the guard), else eager."""
        here = self._served
        down = "compiled" if here == "graphs" and "compiled" in self._passed else "eager"
        reason = f"{type(error).__name__}: {first_line(error)}"
        self.kiln_report.fallbacks.append(Fallback(_LABELS[here], _LABELS[down], reason))
        warn_once(f"train-fb:{self._uid}:{here}", f"torchkiln: the {_LABELS[here]} training step failed ({reason}); "
                  f"stepping down to {_LABELS[down]}")
        self._serve(down)

    def _serve(self, name: str) -> None:
        object.__setattr__(self, "_fn", {"eager": self._eager, "compiled": self._compiled, "graphs": self._graphs}[name])
        object.__setattr__(self, "_served", name)
        self.kiln_report.active = f"{_LABELS[name]} ({self.kiln_recipe.dtype})"

    def _unsplit(self, error: Exception, args, kwargs):
        """The model failed with bf16 weights: if it works with the float32 masters (code that mixes
        dtypes outside autocast), float32 parameters from here on; if not, the error was not the split's
        (a bad input, say): the split stays and the first error is raised."""
        reason = f"{type(error).__name__}: {first_line(error)}"
        self._split.to_masters()
        try:
            out = self._eager(*args, **kwargs)
        except Exception:
            self._split.to_halves()
            raise error from None
        self._split.release()
        object.__setattr__(self, "_split", None)
        self.kiln_report.fallbacks.append(Fallback("split master weights", "float32 parameters", reason))
        warn_once(f"train-split:{self._uid}", f"torchkiln: the model failed with bf16 split weights ({reason}); "
                  "its parameters are float32 again (autocast)")
        object.__setattr__(self, "kiln_recipe", dataclasses.replace(self.kiln_recipe, master_weights="fp32"))
        self.kiln_report.recipe = self.kiln_recipe.to_dict()
        return out

    def _setup(self, args, kwargs) -> None:
        """Verify the compiled steps against eager, time those that pass with eager, serve the fastest."""
        report, t0 = self.kiln_report, time.perf_counter()
        args, kwargs = inputs.detach((args, kwargs))
        cands = {"eager": self._eager, "compiled": self._compiled}
        if self._graphs is not None:
            cands["graphs"] = self._graphs
        rec = self.kiln_recipe
        report.candidates = [Measurement(f"{_LABELS[n]} ({rec.dtype})", "eager" if n == "eager" else "torchkiln",
                                         rec.dtype) for n in cands]
        by = dict(zip(cands, report.candidates, strict=True))
        rivals = [n for n in cands if n != "eager"]
        caches, breaks = _cache_sizes(self.kiln_original), _graph_breaks()
        try:
            verdicts = self._verify(args, kwargs, rivals) if self._opts["verify"] != "off" else \
                {n: (True, "", None) for n in rivals}
        except InputsRejected as e:
            # The caller's error, as eager raises it; nothing is decided, the next call sets up again. Counted
            # against the compiled step, one bad first batch left training eager for good (a new-user probe,
            # thirty-seventh session).
            raise e.error.with_traceback(e.error.__traceback__) from None
        except Exception as e:  # a reference step (eager under autocast) failed: nothing to compare against
            if is_oom(e):
                raise
            verdicts = {n: (False, f"{type(e).__name__}: {first_line(e)}", None) for n in rivals}
        passed = ["eager"]
        for n in rivals:
            ok, why, _ = verdicts[n]
            # Under DDP/FSDP every rank must serve the same step (and time the same number of steps below).
            if not _every_rank(ok, self._device) and ok:
                ok, why = False, "the compiled step was rejected on another rank; every rank serves the same step"
            if ok:
                passed.append(n)
                continue
            what = "rejected" if verdicts[n][2] is not None else "failed"  # a verdict, or an error before one
            by[n].status, by[n].reason = "failed", why
            report.fallbacks.append(Fallback(_LABELS[n], "eager", why))
            warn_once(f"train-guard:{self._uid}:{n}", f"torchkiln: {_LABELS[n]} training step {what} ({why}); "
                      "it does not serve")
        best = self._time({n: cands[n] for n in passed}, by, args, kwargs) if len(passed) > 1 else "eager"
        for n, m in by.items():
            if m.status != "failed":
                m.status = "served" if n == best else "passed"
        object.__setattr__(self, "_passed", tuple(passed))
        self._serve(best)
        full = []
        if best != "eager" and _graph_breaks() > breaks:
            # full before this setup, so it added nothing there: this model's code in that frame runs eager
            full = [n for n, (k, limit) in _cache_sizes(self.kiln_original).items()
                    if k >= limit and caches.get(n, (0, 0))[0] == k]
        if full:
            # A graph break leaves the model class's own frames compiled apart, and their dynamo cache is shared
            # by every model of the class in the process, two entries per optimized model: past dynamo's
            # recompile limit those frames run eager. The report said "compiled" for such a step (a tiny
            # network with a graph break and dropout: from the fifth model on; benchmarks/RESULTS.md,
            # fifty-second session). The timing above measured it as it runs; the report and a warning say so.
            why = (f"dynamo's recompile limit is reached for {', '.join(full[:3])}: code after a graph break is "
                   "compiled per model of the class in this process, and runs eager past the limit")
            report.fallbacks.append(Fallback(f"{_LABELS[best]}, in part", "eager", why))
            report.active += ", parts eager (dynamo's recompile limit)"
            warn_once(f"train-limit:{self._uid}", f"torchkiln: {why}; see model.kiln_report")
        none = (False, "", None)  # the served step's verdict in the report; with eager served, the compiled one's
        shown = verdicts.get(best, none)[2] or verdicts.get("compiled", none)[2]
        if shown is not None:
            report.guard, error, tolerance = shown
            if error is not None:  # None: served unverified (no reference step fits)
                report.verified_shapes, report.error, report.tolerance = 1, error, tolerance
        if best != "eager" and isinstance(self._compiled, OneGraph):
            report.applied.append("one graph under DDP (optimize_ddp=False: all-reduces after the backward)")
        if best != "eager":  # counts stay 0 when the graph came from inductor's cache
            graph_passes = getattr(self._graph_pass, "passes", [self._graph_pass])
            for p in graph_passes:
                if isinstance(p, HashDropoutPass):
                    report.applied.append(f"hash_dropout ({_dropout_said(p)})")
                elif isinstance(p, FullMaskPass) and p.fused:
                    report.applied.append(f"full_mask (attention masks that mask nothing dropped at {p.fused} SDPA "
                                          "sites over the step's compiles: SDPA keeps its fused kernels)")
        report.dtype_served = rec.dtype
        if best == "eager" and len(passed) > 1:
            warn_once(f"train-eager:{self._uid}", "torchkiln: the compiled training step was not faster than "
                      "eager here; eager serves (see model.kiln_report)")
        report.first_call_seconds = round(time.perf_counter() - t0, 3)
        self._keep_memory()

    def _keep_memory(self) -> None:
        """The plan's allocator setting (runtime/allocator.py), applied after the candidates were built
        and timed: with glibc keeping freed memory during the build, bert-base bs8's peak RSS rose
        from 3.6 to 4.4 GiB (blocks of the float32 reference step and the candidates kept apart);
        applied after, the peak stays 3.6 and the steps fault nothing (RESULTS.md, eleventh session)."""
        if self.kiln_recipe.allocator != "keep":
            return
        try:
            said = allocator.keep_freed_memory()
        except OSError as e:
            self.kiln_report.fallbacks.append(Fallback("allocator keeps freed memory", "glibc defaults", str(e)))
            return
        self.kiln_report.applied.append(f"allocator: {said}")

    def _verify(self, args, kwargs, rivals: list[str]) -> dict:
        """{candidate: (ok, why, (guard, worst error, its tolerance) or None)} after one step of each."""
        rec = self.kiln_recipe
        proj: dict = {}  # one projection for all the steps, freed after
        masters = self._split.masters() if self._split is not None else contextlib.nullcontext()
        dtype = DTYPES[rec.dtype]
        truth = "float32 eager"
        own = model_dtype(self.kiln_original)
        if own in (torch.bfloat16, torch.float16):
            # a model cast to bf16 (pure-bf16 fine-tuning) is its own reference, and the compiled step differs
            # from it by that precision's rounding: judged with float32's tolerance, it never served (rel
            # 0.0038 against 0.001; a new-user probe, fiftieth session)
            dtype, truth = own, f"eager {dtype_name(own)} (the model's own parameters)"
        fns = {"compiled": self._compiled, "graphs": self._graphs}
        with probe.untouched(self.kiln_original, self._device, dropout=False) as params:
            ref = None
            try:
                with masters:
                    ref = probe.step(self.kiln_original, params, args, kwargs, cache=proj)  # float32 eager: the truth
            except Exception as e:
                # The float32 step keeps about twice the activations of a bf16/fp16 one (GPT-2-medium bs16 seq512
                # on the H200: tk.optimize peaked at 33 GiB where the stock autocast step takes 13), so a model
                # that trains in low precision may not fit it. Then the eager step in the served precision is
                # the reference, with that precision's cap as the tolerance, and the report says so.
                if not is_oom(e):
                    raise InputsRejected(e) from e
                if dtype == torch.float32:
                    raise
                truth = f"eager {rec.dtype} (the float32 reference step ran out of device memory)"
            if ref is None:  # outside the except block: its traceback no longer holds the failed step's tensors
                _release(self._device)
            base = None
            if rec.precision == "autocast" or ref is None:
                try:
                    base = probe.step(self._eager, params, args, kwargs, cache=proj)
                except Exception as e:
                    if not (is_oom(e) and ref is None):
                        raise
            if ref is None and base is None:
                # Neither reference fits, and the compiled step may (GPT-2-medium bs16 seq512 under a 24 GiB cap on
                # the H200: float32 and eager bf16 ran out, the compiled bf16 step peaks at 15.7 GiB). Serving it
                # unverified, said in the report and a warning, beats failing where the stock recipe trains.
                _release(self._device)
                probe.step(self._compiled, params, args, kwargs, keep=False, cache=proj)  # its OOM is the caller's
                guard = {"ok": None, "reference": "none", "note": (
                    "not verified: the float32 and eager reference steps ran out of device memory; the compiled "
                    "step serves unverified")}
                warn_once(f"train-unverified:{self._uid}", "torchkiln: the compiled training step serves unverified: "
                          "the float32 and eager reference steps do not fit in device memory")
                why = "unverified (the reference steps do not fit in device memory)"
                return {n: (True, why, (guard, None, None)) if n == "compiled" else
                        (False, "not verified: the reference steps do not fit in device memory", None) for n in rivals}
            if ref is None:
                ref, base = base, None
            n_out = len(ref) - len(params)
            scale = _grad_scale(ref[n_out:], dtype)
            base_errors = _errors(base, ref, n_out, scale) if base is not None else None
            del base  # compared already: not held while the compiled step runs
            # eager against itself in the model's own low precision measures no rounding: that precision's cap
            tols = tolerances(dtype, None if dtype == own else base_errors, len(ref),
                              tf32_allowed(self._device, has_conv(self.kiln_original)))
            if base_errors is not None:
                tols = _margins(tols, base_errors, n_out)
            names = tuple(f"output [{i}]" for i in range(n_out)) + tuple(f"gradient [{i}]" for i in range(len(params)))
            out = {}
            for n in rivals:
                got = None
                try:
                    # graph trees run a call eagerly, record the next and replay from the third: the replay is
                    # what serves, so it is what the guard compares
                    for _ in range(2 if n == "graphs" else 0):
                        probe.step(fns[n], params, args, kwargs, keep=False, cache=proj)
                    got = probe.step(fns[n], params, args, kwargs, cache=proj)
                except Exception as e:
                    if not is_oom(e):
                        out[n] = (False, f"{type(e).__name__}: {first_line(e)}", None)
                        continue
                if got is None:
                    _release(self._device)
                    out[n] = (False, "the compiled step ran out of device memory where eager fits", None)
                    continue
                v = Verdict(tuple(_errors(got, ref, n_out, scale)), tuple(tols), names)
                del got
                guard = {"compared": f"{n_out} outputs, then {len(params)} gradients, after one step",
                         "reference": truth, **v.to_dict()}
                worst = max(range(len(v.errors)), key=lambda i: v.errors[i].rel / max(v.tolerances[i], 1e-12))
                out[n] = (v.ok, str(v), (guard, v.errors[worst].to_dict(), v.tolerances[worst]))
        return out

    def _time(self, fns: dict, by: dict, args, kwargs) -> str:
        errors: dict = {}
        with probe.untouched(self.kiln_original, self._device) as params:
            proj: dict = {}
            steps = {n: (lambda fn=fn: probe.step(fn, params, args, kwargs, keep=False, cache=proj))
                     for n, fn in fns.items()}
            slowest = 0.0
            for n, f in list(steps.items()):  # compile (and warm up) outside the clock
                try:
                    f()
                    t = time.perf_counter()
                    f()
                except Exception as e:  # a step that does not fit is out of the race (the other may)
                    if not is_oom(e) or len(steps) == 1:
                        raise
                    errors[n] = torch.OutOfMemoryError(first_line(e))  # not e: its traceback holds the step's tensors
                    del steps[n]
                    continue
                slowest = max(slowest, time.perf_counter() - t)
            if len(steps) < len(fns):
                _release(self._device)
            # A step longer than the whole budget (bert-base on 2 CPU cores: ~8 s) gets one timed
            # round, not three: optimize time stays near the budget the user set.
            rounds = 1 if slowest > self._opts["time_budget"] else 3
            budget, fixed = self._opts["time_budget"], {}
            if _world() > 1:
                # Every backward of a DDP/FSDP model is a collective: ranks must take the same number of
                # steps, so no budget or pruning decided by a rank's own clock.
                rounds = int(_collective([float(rounds)], self._device, "MAX")[0])
                budget, fixed = 0.0, {"max_rounds": rounds, "prune": float("inf")}
            t0 = time.perf_counter()  # the report's "timing": compiling and warming up were above
            times = interleaved(steps, self._device, budget, min_rounds=rounds, errors=errors, **fixed)
        for n, e in errors.items():
            by[n].status, by[n].reason = "failed", f"{type(e).__name__}: {e}"[:300]
        med = {n: statistics.median(t) for n, t in times.items() if t}
        if _world() > 1:  # the same choice on every rank: medians summed over ranks, a failure anywhere fails
            summed = _collective([med.get(n, float("inf")) for n in fns], self._device, "SUM")
            med = {n: m / _world() for n, m in zip(fns, summed, strict=True) if m != float("inf")}
        for n, m in med.items():
            by[n].median_ms, by[n].calls_timed = round(1e3 * m, 4), len(times[n])
        self.kiln_report.selection_seconds = round(time.perf_counter() - t0, 3)
        best = min(med, key=med.get) if med else "eager"
        if "eager" in med and best in med:
            self.kiln_report.speedup = {"vs_eager": round(med["eager"] / med[best], 3)}
        return best

    def extra_repr(self) -> str:
        return f"training, device={self.kiln_recipe.device}, dtype={self.kiln_recipe.dtype}, " \
               f"active={self.kiln_report.active!r}"


def _compile(fn, options: dict | None):
    """torch.compile with inductor options; on a torch that drops the graph pass among them, the
    compiled step runs under a config patch that holds it (the forward's compile, where pre-grad passes
    run; the backward's compile needs none)."""
    compiled = torch.compile(fn, options=options)
    if options and "pre_grad_custom_pass" in options and not _custom_pass_option_kept():
        import torch._inductor.config as inductor_config

        return _Patched(compiled, inductor_config, {"pre_grad_custom_pass": options["pre_grad_custom_pass"]})
    return compiled


@functools.cache
def _custom_pass_option_kept() -> bool:
    """torch 2.6 drops ``pre_grad_custom_pass`` given in ``torch.compile(options=...)`` without a word (its
    option check skips generic types, and the assignment with it), so no graph pass (full_mask,
    hash_dropout) ran in its compiled training steps (seen in the fifty-first session)."""
    try:
        wrapper = torch._TorchCompileInductorWrapper("default", {"pre_grad_custom_pass": None}, None)
    except Exception:  # noqa: BLE001 - a torch without this wrapper: patch, which every torch honours
        return False
    return "pre_grad_custom_pass" in wrapper.config


def _dropout_said(p: HashDropoutPass) -> str:
    """What the dropout pass did in the served step; a step without dropout read "no new compile" (a LoRA
    probe, fifty-second session), the words for a graph that came from inductor's cache."""
    if p.rewritten:
        return f"{p.rewritten} dropout sites in the compiled step"
    return "no dropout in the compiled step" if p.graphs else "no new compile: the graph came from inductor's cache"


def _cache_sizes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{"Class.forward": (dynamo cache entries, recompile limit)} for the model's own forwards. Their code is
    the class's, shared by every model of the class in the process; a full one runs eager from then on."""
    try:
        import torch._dynamo.config as dynamo_config
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    except ImportError:  # pragma: no cover (every torch from 2.6 has both)
        return {}
    limit = LIMIT_FACTOR * _limit(dynamo_config)[1]  # what the step's own calls run under (Traced)
    seen: set = set()
    sizes = {}
    for m in model.modules():
        f = type(m).forward
        while f is not None:  # transformers' decorators (functools.wraps) keep the compiled one as __wrapped__
            code = getattr(f, "__code__", None)
            if code is not None and code not in seen:
                seen.add(code)
                try:
                    sizes[f"{type(m).__name__}.forward"] = (len(entries(code)), limit)
                except Exception:  # noqa: BLE001 - a private helper: no answer is no finding
                    pass
            f = getattr(f, "__wrapped__", None)
    return sizes


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


# The guard compiles the step a second time with dropout off, so each optimized model takes two of dynamo's
# cache entries where stock torch.compile takes one. In frames shared by the models of a class (after a graph
# break) that halved how many models the user's recompile limit allows: the fifth hit it (stock: the ninth).
# The step's own calls run under twice the user's limit (Traced), so torchkiln allows as many models as stock does.
LIMIT_FACTOR = 2


def _limit(dynamo_config) -> tuple[str, int]:
    """dynamo's recompile limit: its config name (torch 2.6 ``cache_size_limit``) and the user's value."""
    key = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    return key, int(getattr(dynamo_config, key))


class _Patched:
    """A compiled step called under a torch config module's patch (inductor's, dynamo's), read when the
    call compiles; process-wide on torch < 2.13 while it lasts: a training loop calls from one thread."""

    def __init__(self, fn, config, options: dict):
        self.fn, self.config, self.options = fn, config, options
        # one patch kept and re-entered where torch keeps its saved values per entry (2.13): building one per
        # call took 15-33 us here, entering a kept one 3-4 (2-core EPYC, torch 2.13), against a tiny model's
        # 0.3 ms compiled step
        self.kept = config.patch(options) if patches_per_thread() else None

    def __call__(self, *args, **kwargs):
        with self.kept if self.kept is not None else self.config.patch(self.options):
            return self.fn(*args, **kwargs)

    def __getattr__(self, name):  # the compiled module's own (``_orig_mod``, ...)
        return getattr(self.__dict__["fn"], name)


class Traced(_Patched):
    """The compiled step under a dynamo config patch read while it traces: LIMIT_FACTOR times the user's
    recompile limit (above), and transformers' once-only log calls (``logger.warning_once``, ``info_once``)
    as no-ops. Each of those was a graph break: GPT-2's ``loss_function`` warns once per call that its
    ``loss_type`` is unset (every GPT2LMHeadModel, checkpoints too), so a step given labels compiled as
    several graphs, the model's nested frames compiled on their own, with their cache shared by every model
    of the class: the fifth GPT-2 optimized in one process hit dynamo's recompile limit and ran those frames
    eager while the report said compiled (tiny GPT-2, CPU; benchmarks/RESULTS.md, fifty-second session).
    The message is not lost: the guard's reference steps run the model eagerly first (not with
    ``verify="off"``), and an lru-cached once-only call prints nothing after its first. Other log calls keep
    their graph break."""

    def __init__(self, fn, **more):
        import torch._dynamo.config as dynamo_config

        key, limit = _limit(dynamo_config)
        options: dict = {key: LIMIT_FACTOR * limit, **more}
        hf = sys.modules.get("transformers.utils.logging")
        once = {f for f in (getattr(hf, "warning_once", None), getattr(hf, "info_once", None)) if f is not None}
        # torch 2.6 names the set ignore_logger_methods; later torch ignore_logging_functions (the old an alias)
        ignore = next((k for k in ("ignore_logging_functions", "ignore_logger_methods") if hasattr(dynamo_config, k)),
                      None)
        if once and ignore is not None:
            options[ignore] = set(getattr(dynamo_config, ignore)) | once
        super().__init__(fn, dynamo_config, options)


class OneGraph(Traced):
    """The compiled step under DDP, compiled with ``optimize_ddp=False``: dynamo traces the step as one
    graph instead of one per gradient bucket (DDPOptimizer), and the all-reduces run after the
    backward instead of overlapping it. GPT-2-medium bs16 seq512 bf16 on H200s, ms per step: one
    process under DDP 57.2 one graph against 68.2-94.3 bucketed (54.1 without DDP); two NVLinked
    processes, stock torch.compile, 61.5 one graph against 68.8 bucketed, torchkiln's bucketed step
    81.7 (benchmarks/RESULTS.md, eighteenth and twentieth sessions). Decided up front, not timed:
    both forms share the user's inner frames' dynamo cache, so timing one against the other
    compared a graph with itself (the eighteenth session's reverted attempt). A slow interconnect
    could favour the overlap; not measured. dynamo reads the switch when it compiles a frame (first
    call, recompile), so every call is wrapped; the patch is process-wide while it lasts, and a
    training loop calls from one thread."""

    def __init__(self, fn):
        super().__init__(fn, optimize_ddp=False)


def _under_ddp(model: nn.Module) -> bool:
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP

    return hasattr(torch._dynamo.config, "optimize_ddp") and any(isinstance(m, DDP) for m in model.modules())


def _release(device: torch.device) -> None:
    """Give back what a step that ran out of memory left cached, before the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective(values: list[float], device: torch.device, op: str) -> list[float]:
    """`values` all-reduced over the process group with ReduceOp `op`; as given without one."""
    if _world() == 1:
        return values
    dist = torch.distributed
    # NCCL reduces CUDA tensors only; gloo takes CPU tensors.
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=where)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()


def _every_rank(ok: bool, device: torch.device) -> bool:
    return _collective([float(ok)], device, "MIN")[0] == 1.0


def _grad_scale(grads: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> float:
    """A floor for the gradients' relative error: 1e-1 of the median gradient norm in float32; in
    bf16/fp16 the larger of 1e-3 and one rounding unit (eps) of it (bf16: 2^-7; fp16's 2^-10 is below). Some gradients are exactly zero in exact arithmetic and
    only rounding noise in practice (attention's key bias: a softmax ignores a constant added to all
    scores); relative to their own norm any two computations differ by ~100% (bert-base, fp32, 0.93).
    In bf16 that noise is eps-sized: bert-base's 12 key-bias gradients read 0.15 of a 1e-3 floor under
    the compiled step on an AMX CPU (benchmarks/RESULTS.md), and the compiled step was rejected for them."""
    norms = sorted(float(g.detach().double().norm()) for g in grads)
    # float32: 1e-1, so with its 1e-4 tolerance a gradient below the floor may differ by 1e-5 of the median
    # norm (bf16's floor allows 8e-5). A conv's bias before a BatchNorm is exactly zero in exact arithmetic
    # (the norm subtracts the mean), and rounding left it 4.7e-8 in eager and ~1e-5 in the compiled step
    # against a median norm of 0.1: the compiled step of a small CNN failed at floors of 1e-3 and 1e-2 (a
    # new-user probe, thirty-seventh session). Gradients above a tenth of the median keep the full 1e-4.
    unit = 1e-1 if dtype == torch.float32 else max(1e-3, torch.finfo(dtype).eps)
    return unit * norms[len(norms) // 2] if norms else 0.0


def _margins(tols: list[float], eager: list, n_out: int) -> list[float]:
    """The tolerances once eager under autocast (what a rejected compiled step falls back to) is known:
    rejecting buys no accuracy where eager itself errs as much, so an output must be within 25% of eager's
    error and a gradient within 2x (the factor ``tolerances`` gives under the cap), even past the cap.
    A deep gradient of a bf16 model is rounding noise (random-init bert-large on the H200: query-weight
    gradients 15% off in eager bf16), and the compiled step rounds at other points, so its noise differs
    by a factor: with cuDNN attention in both, 6 of bert-large's 396 gradients read up to 1.43x eager's
    error. Under the cap ``tolerances`` allows 2x eager + floor, but the cap clipped it, and a gradient
    whose eager error sat just under the cap was held to 1.25x: [374], eager 0.0429, compiled 0.0569 >
    0.0536, and the step was rejected (benchmarks/RESULTS.md, fifty-first session). A wrong gradient
    (relative error ~1 or more) still fails unless eager's own is half that."""
    out = []
    for i, (t, e) in enumerate(zip(tols, eager, strict=True)):
        k = BASELINE_FACTOR if i >= n_out else 1.25
        out.append(max(t, k * e.rel) if e.shapes_match else t)
    return out


def _errors(got, ref, n_out: int, scale: float):
    """Per-tensor errors; a gradient's relative to max(its norm, scale)."""
    errs = compare_each(got, ref)
    for i in range(n_out, min(len(errs), len(ref))):
        norm = float(ref[i].detach().double().norm())
        e = errs[i]
        if e.shapes_match and norm < scale:
            diff = e.rel * norm if norm > 0 else e.rel
            errs[i] = dataclasses.replace(e, rel=diff / scale)
    return errs
