"""Candidates: the ways optimize() can serve a model, built lazily, verified
against the original and timed against each other.

    tier 0 (the requested precision):
      the model as given, eager      "eager" (fp32) | "eager bf16-cast", "eager bf16-autocast",
                                     and as given at float32: "eager (as given, float32)"
      the stock recipe               torch.compile (+freezing on CPU; default and
                                     reduce-overhead on CUDA), as stock.py builds it
      torchkiln's recipe             compiled (with and without CUDA graphs on CUDA),
                                     and its eager passes
    tier 1 (only if nothing in tier 0 passes the guard, the model as given in float32 aside):
      torchkiln's recipe at float32, compiled and eager
    last: the original model (never verified: it is the reference)

This is the seed of the autotuner: candidates and their measurements are data
(report.candidates), so a tuner can add candidates and reuse measurements.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from . import inputs, stock
from ._log import warn_once
from .modelutil import DTYPES, dtype_name, has_conv, hooked, model_device, model_dtype, version
from .passes import registry
from .passes.compile import compile_model
from .passes.onednn_graph import OneDNNGraph
from .recipe import Recipe
from .report import Fallback
from .runner import Runner, build_fast, upcasts

_CPU = torch.device("cpu")


@dataclass
class Candidate:
    name: str
    kind: str  # torchkiln | stock | eager | original
    dtype: str
    make: Callable[[], Callable]  # builds the callable; compilation happens at its first call
    tier: int = 0
    cuda_graphs: bool = False  # outputs live in a graph pool: serve copies, one call at a time
    applied: list[str] = field(default_factory=list)  # passes that ran (torchkiln candidates)
    graph_breaks: Callable[[], Candidate] | None = None  # the same, compiled allowing graph breaks
    # the same with inductor's Python wrapper, for a build with the C++ wrapper that fails otherwise
    python_wrapper: Callable[[], Candidate] | None = None
    serve: bool = True  # False: run only to measure the plain cast's error (the guard's baseline)
    graph_passes: bool = True  # its callable is compiled with the recipe's graph passes
    # It runs the original's own tensors at every call (the model as given, or under autocast): a
    # weight change reaches it without a rebuild, so serving it skips the per-call weight check.
    live_weights: bool = False
    copies: bool = False  # a cuda_graphs callable that makes those copies itself, safely across threads (captured.py)
    # Given the candidates passed so far (name -> callable), why this one need not be built (None: build it)
    skip: Callable[[dict], str | None] | None = None

    @property
    def copy_outputs(self) -> bool:
        """Its outputs live in a graph pool, and the caller copies them out (one call at a time)."""
        return self.cuda_graphs and not self.copies


def applied_for(cand: Candidate) -> list[str]:
    """What the report lists as applied when ``cand`` serves: the build's passes, less those that act
    only in a compiled graph where this candidate has none (the eager and oneDNN Graph candidates share
    the compiled one's build, and its list)."""
    if cand.kind != "torchkiln":
        return []
    if cand.graph_passes:
        return list(cand.applied)
    skip = registry.graph_only()
    return [a for a in cand.applied if a.split(" ", 1)[0] not in skip]


class KilnBuild:
    """One torchkiln recipe applied once, shared by its eager and compiled candidates."""

    def __init__(self, original: nn.Module, recipe: Recipe, sample, inplace: bool, fallbacks: list[Fallback]):
        self.original, self.recipe, self.sample, self.inplace = original, recipe, sample, inplace
        self.fallbacks = fallbacks
        self.applied: list[str] = []
        self._runner: Runner | None = None
        self.compiled: dict = {}  # (options, fullgraph) -> a compiled model candidates share (_compiled)

    def runner(self) -> Runner:
        if self._runner is None:
            own = model_dtype(self.original)  # before the passes: with inplace=True they cast it
            up = upcasts(self.original, self.recipe, self.inplace)
            fast = build_fast(self.original, self.recipe, self.sample, self.inplace, self.applied, self.fallbacks, up)
            self._runner = Runner(fast, self.recipe, own, up)
        return self._runner

    def call(self, fn: Callable, cuda_graphs: bool) -> KilnCall:
        return KilnCall(fn, self, cuda_graphs)


class KilnCall:
    """Serves one torchkiln candidate: calibrates the attention router on the first
    real inputs, drops an all-ones HF attention mask, sets the recipe's backend flags."""

    def __init__(self, fn: Callable, build: KilnBuild, cuda_graphs: bool):
        self.fn, self.build, self.cuda_graphs = fn, build, cuda_graphs
        self.recipe = build.recipe
        self._mask: tuple | None = None  # (weakref to the last mask, its version and storage, all ones?)

    def __call__(self, *args, **kwargs):
        if self.recipe.drop_all_ones_mask:
            kwargs = self._drop_mask(kwargs)
        runner = self.build.runner()
        if not runner.calibrated:
            note = runner.calibrate(args, kwargs)
            if note:
                self.build.applied.append(f"attention ({note})")
        with self._flags():
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            return self.fn(*args, **kwargs)

    def _drop_mask(self, kwargs: dict) -> dict:
        """transformers treats attention_mask=None as all ones, but once traced it keeps
        the mask and builds a 4-D one, which rules out flash attention. A 2-D all-ones
        mask is dropped here, outside the compiled graph."""
        # Reading a CUDA mask's values waits for the GPU: 25 us per call on the H200 (fourteenth
        # session), a tenth of a small model's CUDA-graph replay. The same unchanged tensor as
        # last call (a static input buffer, a benchmark loop) gets the answer it got then.
        m = kwargs.get("attention_mask")
        if not (isinstance(m, torch.Tensor) and m.dim() == 2):
            return kwargs
        key = (version(m), m.data_ptr())
        last = self._mask
        if last is not None and last[0]() is m and last[1] == key:
            ones = last[2]
        else:
            ones = bool(m.all())
            self._mask = (weakref.ref(m), key, ones)
        return {**kwargs, "attention_mask": None} if ones else kwargs

    def _flags(self):
        if not self.recipe.cudnn_benchmark:
            return contextlib.nullcontext()
        c = torch.backends.cudnn
        return c.flags(enabled=c.enabled, benchmark=True, deterministic=c.deterministic, allow_tf32=c.allow_tf32)


def _kiln(build: KilnBuild, tier: int) -> list[Candidate]:
    rec = build.recipe
    # a quantized model's recipe keeps dtype float32 (what its unquantized parts run in); its
    # candidates are named by the scheme, so a report never says "float32" for an int8 graph
    scheme = next((p.scheme for p in rec.passes if p.name == "quantize"), None)
    tag = scheme or rec.dtype
    out = []
    if rec.compile:
        base = dict(rec.compile_options)
        opts = {**base, "triton.cudagraphs": False} if rec.device.startswith("cuda") else base
        out.append(_compiled(build, opts, tag, tier, False))
        if rec.cuda_graphs:
            # The no-graph compiled model again (one compile for both), replayed from CUDA graphs captured
            # by hand: none of dynamo's or the graph trees' host work per call (captured.py says why).
            out.append(_compiled(build, opts, tag, tier, False, capture=True))
            # inductor's graph trees, a compile of their own: after the captured candidate, built only
            # where it could not capture these inputs (or failed), unless TREES_BESIDE_CAPTURED
            trees = _compiled(build, {**base, "triton.cudagraphs": True}, tag, tier, True)
            trees.skip = _trees_needless
            out.append(trees)
    if rec.onednn_graph and rec.device == "cpu" and not build.inplace and scheme is not None:
        def int8_modules():  # imported here: the quantization package stays out of float models' imports
            from .quantization.onednn_int8 import OneDNNInt8
            return build.call(OneDNNInt8(build.original), False)

        def int8_net():
            from .quantization.onednn_net import OneDNNNet
            return build.call(OneDNNNet(build.original), False)

        # the same int8 modules' weights and scales as one oneDNN program (quantization/onednn_net.py):
        # offered where pip's oneDNN and a compiler are here; its build refuses graphs it cannot hold
        from .quantization.onednn_net import available as net_available
        if net_available():
            out.append(Candidate(f"torchkiln oneDNN int8 net ({tag})", "torchkiln", tag, int8_net, tier, False,
                                 build.applied, graph_passes=False))
        out.append(Candidate(f"torchkiln oneDNN int8 modules ({tag})", "torchkiln", tag, int8_modules, tier, False,
                             build.applied, graph_passes=False))
    elif rec.onednn_graph and rec.device == "cpu" and not build.inplace:
        # oneDNN Graph does its own GEMM fusion, and our prepacked linear does not trace
        # (its op takes an optional-scalar list TorchScript rejects): a build without it.
        gbuild = KilnBuild(build.original, rec.without("onednn_linear"), build.sample, False, build.fallbacks)
        out.append(Candidate(f"torchkiln oneDNN graph ({tag})", "torchkiln", tag,
                             lambda: gbuild.call(OneDNNGraph(gbuild.runner()), False), tier, False, gbuild.applied,
                             graph_passes=False))
        if rec.dtype in ("float32", "bfloat16") and has_conv(build.original):
            # the conv trunk as one oneDNN program with Winograd 3x3 convolutions (passes/onednn_conv_net.py):
            # offered where pip's oneDNN and a compiler are here; its build refuses graphs it cannot hold
            from .passes import onednn_conv_net
            if onednn_conv_net.why_not() is None:
                notes: list[str] = []  # its own account: the recipe's passes do not run in it
                out.append(Candidate(f"torchkiln oneDNN conv net ({tag})", "torchkiln", tag,
                                     lambda: build.call(onednn_conv_net.OneDNNConvNet(
                                         build.original, notes=notes, dtype=DTYPES[rec.dtype]), False),
                                     tier, False, notes, graph_passes=False))
    out.append(Candidate(f"torchkiln eager passes ({tag})", "torchkiln", tag,
                         lambda: build.call(build.runner(), False), tier, False, build.applied, graph_passes=False))
    return out


# Build inductor's graph trees even where the hand-captured graphs serve the inputs (benchmarks and
# the CUDA tests of the trees themselves set it).
TREES_BESIDE_CAPTURED = False


def _trees_needless(passed: dict) -> str | None:
    """The graph trees need no compile where a captured-graphs candidate passed holding a graph: on
    the H200 the captured form timed faster in every case measured (bert-base bf16 bs1 0.50 vs 0.91 ms,
    bs64 2.93 vs 3.34, resnet50 bs256 9.50 vs 9.82; benchmarks/diag_captured.py), and the trees' own
    compile was the largest single cost of optimize (bert-base bs64: 14.4 s of 43.6)."""
    if TREES_BESIDE_CAPTURED:
        return None
    for fn in passed.values():
        if isinstance(fn, KilnCall) and hasattr(type(fn.fn), "holds_graph") and fn.fn.holds_graph():
            return "not built: the captured CUDA graphs serve these inputs, faster than the graph trees where measured"
    return None


def _compiled(build: KilnBuild, opts: dict, tag: str, tier: int, graphs: bool, note: str = "",
              capture: bool = False) -> Candidate:
    """torchkiln's compiled candidate, with its step-downs: allowing graph breaks (where
    fullgraph fails on one), and inductor's Python wrapper (where the C++ one fails).
    ``capture``: the compiled model a candidate without graphs builds with these options (the same
    one: shared through the build), called through hand-captured CUDA graphs (captured.py)."""
    suffix = note + (" + CUDA graphs" if graphs else "") + (" + captured CUDA graphs" if capture else "")
    dynamic = False if build.recipe.static_shapes else None
    graph_pass = registry.graph_pass(build.recipe.passes)
    if graph_pass is not None:
        opts = {**opts, "pre_grad_custom_pass": graph_pass}
    key = repr(sorted((k, v) for k, v in opts.items() if k != "pre_grad_custom_pass"))

    def make(fullgraph: bool):
        def build_call():
            model = build.compiled.get((key, fullgraph)) if build.recipe.cuda_graphs else None
            if model is None:
                model = compile_model(build.runner(), opts, fullgraph=fullgraph, private=True, dynamic=dynamic)
                if build.recipe.cuda_graphs:  # only the CUDA graph candidates share (a CPU build frees its own)
                    build.compiled[(key, fullgraph)] = model
            if capture:
                from .captured import Captured  # CUDA only: kept out of other recipes' imports

                return build.call(Captured(model, torch.device(build.recipe.device)), False)
            return build.call(model, graphs)
        return build_call

    def breaks():
        return Candidate(f"torchkiln compiled, graph breaks ({tag}){suffix}", "torchkiln", tag, make(False), tier,
                         graphs or capture, build.applied, copies=capture)

    def python_wrapper():
        plain = {k: v for k, v in opts.items() if k != "cpp_wrapper"}
        return _compiled(build, plain, tag, tier, graphs, ", Python wrapper", capture)

    return Candidate(f"torchkiln compiled ({tag}){suffix}", "torchkiln", tag, make(True), tier, graphs or capture,
                     build.applied, breaks, python_wrapper if opts.get("cpp_wrapper") else None, copies=capture)


def candidates(original: nn.Module, recipe: Recipe, sample, inplace: bool, scope: str,
               fallbacks: list[Fallback], upcast: Recipe | None = None) -> list[Candidate]:
    """Every candidate for this recipe, in the order they are tried. The first one of
    a low-precision tier 0 is the plain cast: its error sets the guard's tolerances.
    ``upcast``: a float32 recipe for a half-precision model this CPU only emulates
    (``upcast_wins``), whose float32 copy competes in tier 0."""
    device = torch.device(recipe.device)
    dtype = DTYPES[recipe.dtype]
    conv = has_conv(original)
    out: list[Candidate] = []
    cast = stock.SharedCast(original)
    # Stock recipes run the original where it lives; with device= elsewhere, only ours compete.
    stock_ok = scope == "auto" and not inplace and model_device(original) == device
    if stock_ok and recipe.level != "O0":
        for r in stock.eager_recipes(dtype):
            out.append(_stock(r, original, device, conv, "eager", cast))
        if dtype != torch.float32 and model_dtype(original) == torch.float32:
            # The model as given competes too: a lower precision is not always faster. On the H200
            # (fifteenth session, wild_zoo) an LSTM ran 0.61x and a GRU 0.93x of eager float32 when
            # served in bfloat16, cast or autocast; on a CPU without native bf16 eager bf16 is emulated.
            out.append(_stock(stock.AS_GIVEN, original, device, conv, "eager", cast))
    elif dtype != torch.float32 and not inplace and model_device(original) == device:
        base = _stock(stock.eager_recipes(dtype)[0], original, device, conv, "eager", cast)  # the plain cast
        base.serve = False
        out.append(base)
    out += _kiln(KilnBuild(original, recipe, sample, inplace, fallbacks), 0)
    if upcast is not None:
        out += _kiln(KilnBuild(original, upcast, sample, inplace, fallbacks), 0)
    if stock_ok and recipe.compile:
        # One stock compile recipe per mode, to bound optimize time: on CPU PyTorch's
        # documented inference recipe (freezing under autocast), on CUDA a cast model.
        how = "autocast" if device.type == "cpu" else "cast"
        for r in stock.compile_recipes(device, dtype):
            if r.how in ("none", how):
                out.append(_stock(r, original, device, conv, "stock", cast))
    if dtype != torch.float32 and not inplace and upcast is None:
        out += _kiln(KilnBuild(original, _fp32(recipe), sample, inplace, fallbacks), 1)
    if not inplace:
        out.append(Candidate("original model", "original", _dtype_of(original), lambda: OnDevice(original), tier=2,
                             live_weights=True))
    hooks = hooked(original)
    if hooks and not inplace:
        # Only candidates that call the model's own modules (eager, a cast copy, autocast) run them.
        why = (f"forward hooks on {', '.join(hooks[:3])}{' and more' if len(hooks) > 3 else ''}: only candidates "
               "that run the model's own modules call them; remove the hooks to let the others compete")
        out = _restrict(out, lambda c: c.kind in ("eager", "original"), why, "hooks", original, fallbacks)
    elif hooks:  # inplace=True transforms the model itself: nothing untouched is left to serve
        warn_once("hooks", f"torchkiln: forward hooks on {', '.join(hooks[:3])} may not run in the "
                  "model transformed in place (inplace=True); use inplace=False to keep them", owner=original)
    return out


def _fp32(recipe: Recipe) -> Recipe:
    return recipe.replace(dtype="float32", dtype_mode="none").without("cast_dtype")


def upcast_wins(original: nn.Module, recipe: Recipe, inplace: bool) -> bool:
    """A float16/bfloat16 model served at its own precision on a CPU that would not plan that dtype (it
    only emulates it): a float32 copy (``upcasts``) is likely faster (fp16 bert-base on a 2-core Zen 5
    without AVX512_FP16: 417 ms a call as given, 134 ms as a float32 copy compiled), at twice the
    weights' memory; timed, not assumed."""
    own = model_dtype(original)
    if recipe.device != "cpu" or DTYPES[recipe.dtype] != own or not upcasts(original, _fp32(recipe), inplace):
        return False
    from .hardware import detect
    from .plan import cpu

    return cpu.choose_dtype(detect(), "cpu", own)[0] != own


def _restrict(out: list[Candidate], keep, why: str, key: str, owner, fallbacks: list[Fallback]) -> list[Candidate]:
    if not any(f.reason == why for f in fallbacks):  # candidates() runs again at each rebuild
        fallbacks.append(Fallback("traced and transformed candidates", "eager ones", why))
    warn_once(key, f"torchkiln: {why}", owner=owner)
    return [c for c in out if keep(c)]


def keeping_state(out: list[Candidate], names: list[str], owner, fallbacks: list[Fallback]) -> list[Candidate]:
    """Only the candidates that run the original's own modules (live_weights: the model as given, under
    autocast, or itself) keep ``names``, the state its forward changes at every call, as eager does: a
    copy (cast, traced, compiled) would advance its own, and a frozen graph none."""
    why = (f"the model's forward changes {', '.join(names[:3])}{' and more' if len(names) > 3 else ''} at every "
           "call (state only its own modules keep); only candidates that run them compete")
    return _restrict(out, lambda c: c.live_weights, why, "state", owner, fallbacks)


def keeping_inputs(out: list[Candidate], owner, fallbacks: list[Fallback]) -> list[Candidate]:
    """Only the candidates that run the original's own modules on the caller's tensors, for a forward that
    writes into its inputs (``x.mul_(2)``): a compiled candidate fed a cast copy left the caller's tensor as
    it was, where eager doubles it (a new-user probe, fiftieth session)."""
    why = ("the model's forward writes into its inputs in place, which a candidate fed a cast or traced copy would "
           "not pass back to the caller; only candidates that run the model on the caller's own tensors compete")
    return _restrict(out, lambda c: c.live_weights, why, "inputs", owner, fallbacks)


def _stock(r: stock.StockRecipe, original, device, conv: bool, kind: str, cast: stock.SharedCast) -> Candidate:
    # The original is used as is (never changed: a cast works on a copy, one shared by the
    # recipes that cast), on its device.
    return Candidate(r.name, kind, r.dtype, lambda: stock.build(r, original, device, cudnn_benchmark=conv, cast=cast),
                     cuda_graphs=r.cuda_graphs, live_weights=not r.compile and r.how != "cast")


def _dtype_of(model: nn.Module) -> str:
    return dtype_name(model_dtype(model))


class OnDevice:
    """The original model, with inputs moved to its device (it may live elsewhere than
    the recipe's device, when optimize() was given ``device=``)."""

    def __init__(self, model: nn.Module):
        self.model = model
        # Its first weight, whose device each call reads: model_device's walk over the modules was 4 of
        # the ~9 us a call this class added to an MLP's 360 at one row (2-core Zen 4, thirty-fifth session).
        # .to() moves a parameter in place (the same object); a weight replaced in its slot is a weight
        # change, after which the candidates, this one included, are made again.
        self._first = next(itertools.chain(model.parameters(), model.buffers()), None)

    def __call__(self, *args, **kwargs):
        dev = self._first.device if self._first is not None else _CPU
        args, kwargs = inputs.to((args, kwargs), dev)
        return self.model(*args, **kwargs)
