"""The stock-PyTorch recipes a skilled user would write by hand, as data.

One place for them, because two parts of torchkiln need the same ones:
``optimize`` times them as candidates (and serves one if it is fastest: the
user never gets less than stock), and ``bench`` times them as peers. Each
recipe builds a callable that takes the model's inputs and returns outputs in
the input's floating dtype, as torchkiln's own model does.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import inputs
from .modelutil import model_dtype
from .passes.compile import Fresh, compile_model

_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class StockRecipe:
    name: str  # as printed in reports and bench tables
    dtype: str  # compute dtype: float32 | bfloat16 | float16
    how: str = "none"  # none | cast (weights and inputs) | autocast
    compile: bool = False
    mode: str | None = None  # torch.compile mode: None | reduce-overhead | max-autotune-no-cudagraphs
    freezing: bool = False  # inductor freezing (the CPU inference recipe in PyTorch's docs)

    @property
    def cuda_graphs(self) -> bool:
        return self.mode == "reduce-overhead"

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "how": self.how, "compile": self.compile,
                "mode": self.mode, "freezing": self.freezing}


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def eager_recipes(dtype: torch.dtype) -> list[StockRecipe]:
    """The model as the user gave it, at the requested precision."""
    if dtype == torch.float32:
        return [StockRecipe("eager", "float32")]
    low = _LOW[dtype]
    return [StockRecipe(f"eager {low}-cast", _dname(dtype), "cast"),
            StockRecipe(f"eager {low}-autocast", _dname(dtype), "autocast")]


# The float32 model as given, where a lower precision was asked for: what that precision must beat.
AS_GIVEN = StockRecipe("eager (as given, float32)", "float32")


def compile_recipes(device: torch.device, dtype: torch.dtype, autotune: bool = False) -> list[StockRecipe]:
    """torch.compile the way the docs teach it: freezing on CPU; on CUDA the default
    mode, ``reduce-overhead`` (CUDA graphs) and, when asked, ``max-autotune-no-cudagraphs``."""
    freeze = device.type == "cpu"
    tag = "+freezing" if freeze else ""
    hows = ["none"] if dtype == torch.float32 else ["cast", "autocast"]
    modes: list[str | None] = [None]
    if device.type == "cuda":
        modes.append("reduce-overhead")
        if autotune:
            modes.append("max-autotune-no-cudagraphs")
    out = []
    for mode in modes:
        for how in hows:
            name = f"compile{tag}" + (f" {_LOW[dtype]}-{how}" if how != "none" else "") + (f" {mode}" if mode else "")
            out.append(StockRecipe(name, _dname(dtype), how, True, mode, freeze))
    return out


class SharedCast:
    """One cast copy of a model for every recipe that casts it. Compiling wraps a module
    without changing its tensors, so the eager, compile and reduce-overhead recipes can run
    the same copy; optimize() builds them side by side, and bert-base bf16 on the H200 held
    three copies at once otherwise (benchmarks/RESULTS.md, tenth session). Held weakly: the
    copy goes with the last recipe built on it, and the next build makes a new one."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._copies: dict[torch.dtype, weakref.ref] = {}

    def __call__(self, dtype: torch.dtype) -> nn.Module:
        ref = self._copies.get(dtype)
        copied = ref() if ref is not None else None
        if copied is None:
            copied = copy.deepcopy(self.model).to(dtype)
            self._copies[dtype] = weakref.ref(copied)
        return copied


def build(recipe: StockRecipe, model: nn.Module, device: torch.device, cudnn_benchmark: bool = False,
          cast: SharedCast | None = None) -> Callable:
    """A callable running ``recipe`` on ``model``. ``model`` is never changed: a cast
    works on a copy (``cast``'s, shared with other recipes, when given); compilation
    wraps it without touching its tensors."""
    dtype = getattr(torch, recipe.dtype)
    own = model_dtype(model)  # what the model as given answers in, with no floating input to follow
    if recipe.how == "cast":
        model = cast(dtype) if cast is not None else copy.deepcopy(model).to(dtype)
    fn: Callable = model
    if recipe.compile:
        if recipe.freezing:
            fn = compile_model(model, {"freezing": True})
        else:
            fn = torch.compile(Fresh(model), mode=recipe.mode)
    return _Call(fn, recipe, device, dtype, cudnn_benchmark, own)


class _Call:
    """Input cast / autocast / output cast-back around a stock callable."""

    def __init__(self, fn, recipe: StockRecipe, device: torch.device, dtype: torch.dtype, cudnn_benchmark: bool,
                 own_dtype: torch.dtype = torch.float32):
        self.fn, self.recipe, self.device, self.dtype, self.own_dtype = fn, recipe, device, dtype, own_dtype
        self.cudnn_benchmark = cudnn_benchmark and device.type == "cuda"

    def __call__(self, *args, **kwargs):
        if self.recipe.how == "none" and not self.recipe.cuda_graphs and not self.cudnn_benchmark:
            # Nothing to put around it: the pytree walk and context stack below cost ~15 us a call, 4% of
            # an MLP's 0.36 ms at one row served as given (2-core Zen 4, thirty-fifth session).
            return self.fn(*args, **kwargs)
        out_dtype = next((t.dtype for t in inputs.flatten((args, kwargs)) if t.is_floating_point()), self.own_dtype)
        if self.recipe.how == "cast":
            args, kwargs = inputs.to((args, kwargs), dtype=self.dtype)
        with self._context():
            if self.recipe.cuda_graphs:
                # A new step for cudagraph trees: earlier outputs may be overwritten by this replay.
                torch.compiler.cudagraph_mark_step_begin()
            out = self.fn(*args, **kwargs)
        if self.recipe.how != "none":
            out = inputs.tree_map(lambda t: t.to(out_dtype) if t.is_floating_point() else t, out)
        return out

    def _context(self):
        stack = contextlib.ExitStack()
        if self.recipe.how == "autocast":
            stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype))
        if self.cudnn_benchmark:
            c = torch.backends.cudnn
            stack.enter_context(c.flags(enabled=c.enabled, benchmark=True, deterministic=c.deterministic,
                                        allow_tf32=c.allow_tf32))
        return stack


def pt2e_int8(model: nn.Module, args: tuple, kwargs: dict, calib, strict_order=(False, True), say=print) -> nn.Module:
    """Stock int8 as torchao's pt2e tutorial builds it: export, X86InductorQuantizer, calibrate
    on ``calib`` ((args, kwargs) pairs), convert. Not compiled. The benchmarks' stock int8 peer.

    ``strict_order``: the export modes tried in turn. The tutorial's export (non-strict, torch
    2.13's default) is refused by torchao on a ResNet bottleneck's shared ReLU; a user who reads
    that error retries with strict export, so the next mode runs and ``say`` reports why.
    """
    from .quantization import pt2e_flow
    from .quantization.config import QuantConfig

    _, prepare_pt2e, _ = pt2e_flow._pt2e()
    for i, strict in enumerate(strict_order):
        try:
            graph = torch.export.export(copy.deepcopy(model), args, kwargs, strict=strict).module()
            prepared = prepare_pt2e(graph, pt2e_flow.quantizer(QuantConfig("int8-static")))
            break
        except Exception as e:
            if i == len(strict_order) - 1:
                raise
            say(f"stock pt2e, export strict={strict}: {str(e).splitlines()[0][:160]}; trying the next mode")
    with torch.no_grad():
        for a, k in calib:
            prepared(*a, **k)
    return pt2e_flow.convert(prepared)
