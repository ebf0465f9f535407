"""An average pool whose window covers its whole input, as a mean over the spatial dimensions, in the
compiled graph.

Why: transformers' EfficientNet pools with ``nn.AvgPool2d(1280, ceil_mode=True)`` on a 7 x 7 map, and
inductor lowers the pool as a masked reduction over the whole 1280 x 1280 window for every channel:
one kernel took 217 of the 228 ms of a compiled batch-1 call on 2 Zen 5 cores (eager: 20 ms;
torch.profiler with ``cpp.enable_kernel_profile``, RESULTS.md "Forty-ninth session"). The pool's value
is the mean (its window, clipped to the input, holds every element once, and with no padding the
divisor is the input's size), which inductor reduces in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .fxargs import call_args, pair, traced
from .registry import CountingPass, register_graph_only

_AVG = (torch._C._nn.avg_pool2d, torch.ops.aten.avg_pool2d.default)


def _shape(node) -> tuple | None:
    v = traced(node)
    return tuple(v.shape) if v is not None else None


def _whole(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _AVG:
        return False
    a = call_args(node, torch.ops.aten.avg_pool2d.default)  # the builtin has no Python signature
    shape, out = _shape(a["input"]), _shape(node)
    if shape is None or out is None or len(shape) < 3 or out[-2:] != (1, 1) or a["divisor_override"] is not None:
        return False
    if pair(a["padding"]) != (0, 0) or not all(isinstance(s, int) for s in shape[-2:]):
        return False
    return all(k >= s for k, s in zip(pair(a["kernel_size"]), shape[-2:], strict=True))


def rewrite(graph: torch.fx.Graph) -> int:
    """avg_pool2d over its whole input -> mean over (H, W), keepdim; returns how many."""
    n = 0
    for node in list(graph.nodes):
        if not _whole(node):
            continue
        x = call_args(node, torch.ops.aten.avg_pool2d.default)["input"]
        with graph.inserting_before(node):
            if node.target is torch.ops.aten.avg_pool2d.default:
                new = graph.call_function(torch.ops.aten.mean.dim, (x, [-2, -1], True))
            else:
                new = graph.call_function(torch.mean, (x,), {"dim": (-2, -1), "keepdim": True})
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        n += 1
    return n


def has_avg_pool(model: nn.Module) -> bool:
    """An AvgPool2d module, or an avg_pool2d call in a graph module (a pt2e-quantized model's)."""
    return any(isinstance(m, nn.AvgPool2d) or (isinstance(m, torch.fx.GraphModule) and any(
        n.op == "call_function" and n.target in _AVG for n in m.graph.nodes)) for m in model.modules())


class GlobalAvgPoolPass(CountingPass):
    """The inductor pre-grad hook."""

    source = __file__
    rewrite = staticmethod(rewrite)


@dataclass(frozen=True)
class GlobalAvgPoolConfig:
    name: ClassVar[str] = "global_avg_pool"


register_graph_only(GlobalAvgPoolConfig, 85, "in the compiled graph", lambda config: GlobalAvgPoolPass())
