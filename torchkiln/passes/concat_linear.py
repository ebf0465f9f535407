"""Concatenate sibling nn.Linears that read the same input (Q, K, V) into one GEMM.

One wide GEMM uses the cores better than three narrow ones. Which siblings
share an input is learnt from one sample run (forward pre-hooks record the input
tensor object each Linear got), since module code, not the module tree, decides
dataflow. The replacement stays correct even when that guess is wrong: a sibling
reuses the fused result only if it is called with the very same input tensor
object, and computes its own slice otherwise.

Inductor's freezing does the same for aten.mm on GPU; on CPU it is off by
default and does not see linears routed to oneDNN, hence this pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .registry import Skip, register
from .sample_run import run_with_linear_hooks


class _Group(nn.Module):
    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        w = linears[0].weight
        self.fused = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                               bias=linears[0].bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.fused.weight.copy_(torch.cat([m.weight for m in linears]))
            if self.fused.bias is not None:
                self.fused.bias.copy_(torch.cat([m.bias for m in linears]))
        self.n = len(linears)
        self.cache = None  # (input, output, consumers left)


class ConcatSlice(nn.Module):
    def __init__(self, group: _Group, start: int, end: int, owner: bool):
        super().__init__()
        self.start, self.end = start, end
        if owner:  # the first sibling registers the group (so it moves and casts with the model);
            self.group = group  # the others hold a plain reference, so containers never call it
        else:
            object.__setattr__(self, "group", group)

    def forward(self, x):
        g = self.group
        c = g.cache
        if c is not None and c[0] is x:
            y, left = c[1], c[2] - 1
        else:
            y, left = g.fused(x), g.n - 1
        # Drop the cached activations once every sibling has taken its slice.
        g.cache = (x, y, left) if left > 0 else None
        return y[..., self.start:self.end]


def find_groups(model: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, list[str]]]:
    """[(parent_name, [child names])] of Linears under one parent that got the same input."""
    seen: dict = {}  # name -> the input tensor itself: holding it keeps its id() unique
    run_with_linear_hooks(model, args, kwargs, lambda name, mod, inp: seen.setdefault(name, inp))
    by_key: dict = {}
    for name, inp in seen.items():
        parent, _, child = name.rpartition(".")
        mod = model.get_submodule(name)
        key = (parent, id(inp), mod.in_features, mod.bias is not None, mod.weight.dtype)
        by_key.setdefault(key, []).append(child)
    return [(k[0], kids) for k, kids in by_key.items() if len(kids) > 1]


def concat_linear(model: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
    for parent_name, kids in find_groups(model, args, kwargs):
        parent = model.get_submodule(parent_name) if parent_name else model
        linears = [getattr(parent, k) for k in kids]
        group = _Group(linears)
        start = 0
        for i, (k, lin) in enumerate(zip(kids, linears, strict=True)):
            setattr(parent, k, ConcatSlice(group, start, start + lin.out_features, owner=i == 0))
            start += lin.out_features
    return model


@dataclass(frozen=True)
class ConcatLinearConfig:
    name: ClassVar[str] = "concat_linear"


@register(ConcatLinearConfig, order=40)
def _apply(model, config, ctx):
    if ctx.sample is None:
        raise Skip("needs sample_input to see which linears share an input")
    groups = find_groups(model, *ctx.sample)
    concat_linear(model, *ctx.sample)
    return model, f"{len(groups)} groups ({sum(len(k) for _, k in groups)} linears)"
