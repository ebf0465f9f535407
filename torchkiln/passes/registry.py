"""The pass registry (the torchao pattern: a frozen config dataclass per pass,
and a handler looked up by the config's pass name).

A pass file registers itself::

    @dataclass(frozen=True)
    class FoldConvBNConfig:
        name: ClassVar[str] = "fold_conv_bn"

    @register(FoldConvBNConfig, order=20)
    def _apply(model, config, ctx) -> tuple[nn.Module, str]:
        ...
        return model, "3 folded"

The Recipe holds the ordered configs; ``build_fast`` runs ``lookup(config.name)``
for each. Quantization, training and LLM passes register the same way.

A graph pass rewrites the FX graph torch.compile captures instead of the module (its
module-level ``apply`` leaves the model alone); it registers a factory with
``register_graph``, and the compiled candidates install what ``graph_passes`` returns as
inductor's pre-grad pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


class Skip(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a pass that does not apply here (e.g. it needs a sample input)."""


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the model and its own config."""

    device: torch.device
    dtype: torch.dtype  # the compute dtype of the recipe
    sample: tuple | None = None  # (args, kwargs) as the fast model sees them (device, dtype), or None


@dataclass(frozen=True)
class PassInfo:
    name: str
    config: type
    apply: Callable[[nn.Module, object, PassContext], tuple[nn.Module, str]]
    order: int  # where it runs relative to other passes (ascending)


_PASSES: dict[str, PassInfo] = {}
_GRAPH: dict[str, Callable[[object], Callable[[torch.fx.Graph], None]]] = {}


def register(config_cls: type, order: int):
    name = config_cls.name
    if not dataclasses.is_dataclass(config_cls) or not config_cls.__dataclass_params__.frozen:
        raise TypeError(f"pass {name!r}: its config must be a frozen dataclass")

    def deco(fn):
        if name in _PASSES and _PASSES[name].apply is not fn:
            raise ValueError(f"pass {name!r} is already registered")
        _PASSES[name] = PassInfo(name, config_cls, fn, order)
        return fn
    return deco


def register_graph(config_cls: type):
    """Registers ``fn(config) -> graph pass`` for a pass already registered with ``register``."""
    def deco(fn):
        _GRAPH[config_cls.name] = fn
        return fn
    return deco


def register_graph_only(config_cls: type, order: int, note: str, factory: Callable[[object], Callable]) -> None:
    """A pass that only rewrites the captured graph: its module-level step leaves the model as it is."""
    register(config_cls, order)(lambda model, config, ctx: (model, note))
    register_graph(config_cls)(factory)
    _GRAPH_ONLY.add(config_cls.name)


_GRAPH_ONLY: set[str] = set()


def graph_only() -> frozenset[str]:
    """Names of the passes that act only inside a compiled graph (nothing to report for an eager candidate)."""
    return frozenset(_GRAPH_ONLY)


try:  # inductor caches compiled graphs keyed on a custom pass's uuid() only for this class
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # pragma: no cover (older torch: the pass runs, its graphs are not cached)
    _PassBase = object


class GraphPass(_PassBase):
    """Base of torchkiln's pre-grad graph passes. ``uuid`` is the hash of the pass's own source file, so
    inductor's FX graph cache holds their graphs (without it torch 2.13 warns and bypasses the cache),
    with the pass's ``options()``, so two configurations never share a cached graph. On a cache hit
    the pass does not run: its counters then stay 0."""

    source: str = ""  # the pass module's __file__

    def __call__(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def options(self) -> tuple:
        """What else, besides the source, decides the rewrite."""
        return ()

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(self.source).read_bytes() + repr(self.options()).encode()).digest()


class CountingPass(GraphPass):
    """A graph pass that is one rewrite function, ``rewrite(graph) -> how many``; ``fused`` counts the
    rewrites over the compiles it served. Subclasses set ``source`` and ``rewrite`` (a staticmethod)."""

    rewrite: Callable[[torch.fx.Graph], int]

    def __init__(self):
        self.fused = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.fused += self.rewrite(graph)


def graph_pass(configs) -> Callable[[torch.fx.Graph], None] | None:
    """One callable running the graph passes among ``configs`` (a Recipe's passes) in order, or None."""
    _load()
    passes = [_GRAPH[c.name](c) for c in configs if c.name in _GRAPH]
    if len(passes) < 2:
        return passes[0] if passes else None
    return _Chain(passes)


class _Chain(GraphPass):
    def __init__(self, passes: list):
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes:
        return b"".join(p.uuid() for p in self.passes)


def _load() -> None:
    from . import (  # noqa: F401 - importing registers them
        cast_dtype,
        channels_last,
        concat_linear,
        fold_conv_bn,
        fold_linear_bn,
        full_mask,
        gelu_epilogue,
        global_avg_pool,
        hash_dropout,
        int8_linear,
        onednn_linear,
        pad_conv_channels,
        replace_dropout,
    )


def names() -> list[str]:
    _load()
    return sorted(_PASSES, key=lambda n: _PASSES[n].order)


def lookup(name: str) -> PassInfo:
    _load()
    if name not in _PASSES:
        raise ValueError(f"unknown pass {name!r}; registered passes: {names()}")
    return _PASSES[name]


def make(name: str, **options):
    """A pass config by name: ``make("cast_dtype", dtype="bfloat16")``."""
    return lookup(name).config(**options)


def ordered(configs) -> tuple:
    """Configs sorted into run order; one config per pass name (the last one given wins)."""
    by_name = {c.name: c for c in configs}
    for n in by_name:
        lookup(n)
    return tuple(sorted(by_name.values(), key=lambda c: _PASSES[c.name].order))


def to_dict(config) -> dict:
    return {"pass": config.name, **{f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}}


def from_dict(d: dict):
    d = dict(d)
    info = lookup(d.pop("pass"))
    fields = {f.name for f in dataclasses.fields(info.config)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"pass {info.name!r} has no options {sorted(unknown)}; it takes {sorted(fields)}")
    return info.config(**{k: _tuple(v) for k, v in d.items()})


def _plain(v):
    return [_plain(x) for x in v] if isinstance(v, tuple) else v


def _tuple(v):
    return tuple(_tuple(x) for x in v) if isinstance(v, list) else v


def run_pass(name: str, model: nn.Module, ctx: PassContext | None = None, **options) -> tuple[nn.Module, str]:
    """Run one registered pass by name (what build_fast does for each recipe entry)."""
    ctx = ctx or PassContext(torch.device("cpu"), torch.float32)
    return lookup(name).apply(model, make(name, **options), ctx)
