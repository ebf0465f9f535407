"""Graph capture with torch.compile, configured by the recipe.

Inductor options are applied with ``torch._inductor.config.patch`` around every
call rather than ``torch.compile(options=...)``: on torch 2.13 ``options=
{"freezing": True}`` does not freeze parameters into constants, and inductor's
oneDNN lowering then fails (``assert w.get_name() in V.graph.constants``).
Compilation is lazy and may recur on any call (a new shape), so the patch
wraps each call; it costs microseconds, and nothing global stays changed.
"""

from __future__ import annotations

import torch
from torch import nn


class Compiled(nn.Module):
    def __init__(self, model: nn.Module, options: dict, fullgraph: bool = False, dynamic: bool | None = None):
        super().__init__()
        self.options = dict(options)
        self.compiled = torch.compile(model, backend="inductor", fullgraph=fullgraph, dynamic=dynamic)

    def forward(self, *args, **kwargs):
        import torch._inductor.config as inductor_config

        with inductor_config.patch(self.options):
            return self.compiled(*args, **kwargs)


def compile_model(model: nn.Module, options: dict, fullgraph: bool = False, dynamic: bool | None = None) -> nn.Module:
    return Compiled(model, options, fullgraph, dynamic)
