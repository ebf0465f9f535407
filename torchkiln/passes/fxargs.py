"""A graph node's call arguments by name, shared by the passes that read ATen or torch calls
(onednn_conv_net, global_avg_pool, quantization/conv_padding), and what tracing saw at a node."""

from __future__ import annotations

import inspect

import torch
from torch import fx


def traced(node) -> torch.Tensor | None:
    """The tensor tracing saw at ``node`` (dynamo's ``example_value``, an exported graph's ``val``), or None."""
    v = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def pair(v) -> tuple:
    """A 2-D size given as one int or a pair."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def call_args(node: fx.Node, schema: torch._ops.OpOverload | None = None) -> dict:
    """A call's arguments by name, defaults filled in (an ATen op's first, ``self``, as ``input``).
    ``schema``: the ATen op whose schema binds a builtin without a Python signature
    (``torch._C._nn.avg_pool2d`` as ``aten.avg_pool2d.default``). Bound here: torch 2.6's
    ``Node.normalized_arguments`` leaves some positional ones out."""
    fn = schema or node.target
    if isinstance(fn, torch._ops.OpOverload):
        out = {}
        for i, a in enumerate(fn._schema.arguments):
            name = "input" if a.name == "self" else a.name
            if i < len(node.args):
                out[name] = node.args[i]
            elif a.name in node.kwargs:
                out[name] = node.kwargs[a.name]
            elif a.has_default_value():
                out[name] = a.default_value
        return out
    bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
