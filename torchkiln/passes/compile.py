"""Graph capture with torch.compile, configured by the recipe.

Inductor options are applied with ``torch._inductor.config.patch`` around every
call rather than ``torch.compile(options=...)``: on torch 2.13 ``options=
{"freezing": True}`` does not freeze parameters into constants, and inductor's
oneDNN lowering then fails (``assert w.get_name() in V.graph.constants``).
Compilation is lazy and may recur on any call (a new shape), so the patch
wraps each call; it is a few attribute writes, and nothing global stays changed.
"""

from __future__ import annotations

import itertools
import types

import torch
from torch import nn

_ids = itertools.count()


class Fresh(nn.Module):
    """Calls ``model`` through a forward with a code object of its own.

    dynamo keys compiled code (and its recompile limit of 8) on code objects, and
    with inlined nn.Modules two instances of one class can share compiled code.
    Each Fresh wrapper gets a distinct cache, so compiled models never share
    graphs (frozen weights are constants in them) nor exhaust each other's limit.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        code = Fresh._forward.__code__.replace(co_name=f"kiln_forward_{next(_ids)}")
        self.forward = types.MethodType(types.FunctionType(code, Fresh._forward.__globals__), self)

    def _forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def _guard_filter():
    """Skip dynamo's guards on nn.Module state (guard evaluation showed up in
    torch.profiler traces of small-batch calls). Sound only because torchkiln's runner is private and never mutated
    after optimize(); torch >= 2.8 has the filter, older torch keeps every guard."""
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    return {"guard_filter_fn": skip} if skip is not None else {}


class Compiled(nn.Module):
    def __init__(self, model: nn.Module, options: dict, fullgraph: bool = False, private: bool = False,
                 dynamic: bool | None = None):
        super().__init__()
        self.options = dict(options)
        extra = _guard_filter() if private else {}
        self.compiled = torch.compile(Fresh(model), backend="inductor", fullgraph=fullgraph, dynamic=dynamic,
                                      options=extra or None)

    def forward(self, *args, **kwargs):
        import torch._inductor.config as inductor_config

        with inductor_config.patch(self.options):
            return self.compiled(*args, **kwargs)


def compile_model(model: nn.Module, options: dict, fullgraph: bool = False, private: bool = False,
                  dynamic: bool | None = None) -> nn.Module:
    """``private=True``: the caller guarantees ``model`` is never mutated afterwards. ``dynamic``
    is torch.compile's: None lets a second input shape recompile with symbolic sizes."""
    return Compiled(model, options, fullgraph, private, dynamic)
