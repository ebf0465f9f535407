"""pt2e int8 linears on the CPU as ``torchkiln::qlinear_u8`` (kernels/cpu_qlinear.cpp) in the
compiled graph, instead of inductor's ``onednn::qlinear_pointwise``.

Why hand-written: both run the same oneDNN brgemm kernel, but inductor's op rebuilds its primitive's
scales and zero points and allocates a scratchpad on every call, 11-20 us per call at bert-base's
shapes (128 rows; 2-core Zen 5, benchmarks/diag_int8_linear.py), 49 calls per bert-base forward.
torch has no op that keeps a built primitive, so this pass swaps the pattern, in the graph dynamo
captures (inductor's pre-grad hook, before freezing lowers it), for an op that does.

The pattern, as pt2e's convert leaves it (X86InductorQuantizer: uint8 activations with a zero
point, symmetric per-channel int8 weights):

    linear(dequantize_per_tensor(x_u8), dequantize_per_channel(w_s8, axis 0), bias)
        -> qlinear_u8(x_u8, ..., "none")                                  float32 out
    ... -> gelu -> quantize_per_tensor(uint8)
        -> qlinear_u8(x_u8, ..., "gelu_erf" | "gelu_tanh", scale, zp)      uint8 out (FFN1)

A residual add after the linear is left to inductor, which fuses it with the layer norm and the next
quantize that read it anyway. Numerics: the same as inductor's lowering (int32 accumulation, scales
applied in float32; requantized codes may differ by one step where a value lands on a boundary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .registry import CountingPass, register_graph_only


def _ops():
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers quantized_decomposed

    qd = torch.ops.quantized_decomposed
    return qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default


def _args(node, n):
    return (list(node.args) + [None] * n)[:n]


def _u8_dequantize(node):
    """(x, scale, zp) of a dequantize_per_tensor of uint8 codes with scalar parameters, else None."""
    _, dq, _ = _ops()
    if not (isinstance(node, torch.fx.Node) and node.target is dq and not node.kwargs):
        return None
    x, scale, zp, lo, hi, dtype = _args(node, 6)
    if (lo, hi, dtype) != (0, 255, torch.uint8) or not isinstance(scale, float) or not isinstance(zp, int):
        return None
    return x, scale, zp


def _s8_weight(node):
    """(codes, scales, zero points) of a per-channel int8 weight over axis 0, else None."""
    _, _, dqc = _ops()
    if not (isinstance(node, torch.fx.Node) and node.target is dqc and not node.kwargs):
        return None
    w, scales, zps, axis, lo, hi, dtype = _args(node, 7)
    if (axis, lo, hi, dtype) != (0, -128, 127, torch.int8):
        return None
    return w, scales, zps


def _gelu_quantize(lin):
    """(gelu node, quantize node, post) where the linear's only use is gelu -> uint8 quantize."""
    q, _, _ = _ops()
    if len(lin.users) != 1:
        return None
    g = next(iter(lin.users))
    if g.target is not torch.ops.aten.gelu.default or len(g.users) != 1 or len(g.args) != 1:
        return None
    approximate = g.kwargs.get("approximate", "none")
    if set(g.kwargs) - {"approximate"} or approximate not in ("none", "tanh"):
        return None
    qn = next(iter(g.users))
    if qn.target is not q or qn.kwargs:
        return None
    _, scale, zp, lo, hi, dtype = _args(qn, 6)
    if (lo, hi, dtype) != (0, 255, torch.uint8) or not isinstance(scale, float) or not isinstance(zp, int):
        return None
    return g, qn, "gelu_erf" if approximate == "none" else "gelu_tanh"


def rewrite(graph: torch.fx.Graph) -> int:
    """Rewrites the int8 linears of a dynamo graph; returns how many (none where the op cannot be
    built here)."""
    from ..kernels import cpu_qlinear

    if cpu_qlinear.load() is not None:
        return 0
    n = 0
    for lin in list(graph.nodes):
        if lin.op != "call_function" or lin.target is not torch.ops.aten.linear.default or lin.kwargs:
            continue
        x_node, w_node, bias = _args(lin, 3)
        x, w = _u8_dequantize(x_node), _s8_weight(w_node)
        if x is None or w is None:
            continue
        fused = _gelu_quantize(lin)
        post, out_scale, out_zp, last = "none", 0.0, 0, lin
        if fused is not None:
            g, last, post = fused
            out_scale, out_zp = last.args[1], last.args[2]
        with graph.inserting_before(last):
            # the op takes float32 scales (oneDNN's); a float64 observer's scales are cast here, once,
            # where freezing folds the cast into the constant
            scales = graph.call_function(torch.ops.aten._to_copy.default, (w[1],), {"dtype": torch.float32})
            new = graph.call_function(torch.ops.torchkiln.qlinear_u8.default,
                                      (x[0], x[1], x[2], w[0], scales, w[2], bias, post, out_scale, out_zp))
        new.meta.update(last.meta)
        last.replace_all_uses_with(new)
        for node in ([last, g] if fused is not None else []) + [lin, w_node, x_node]:
            if not node.users:
                graph.erase_node(node)
        n += 1
    return n


class Int8LinearPass(CountingPass):
    """The inductor pre-grad hook."""

    source = __file__
    rewrite = staticmethod(rewrite)


@dataclass(frozen=True)
class Int8LinearConfig:
    name: ClassVar[str] = "int8_linear"


register_graph_only(Int8LinearConfig, 91, "in the compiled graph", lambda config: Int8LinearPass())
