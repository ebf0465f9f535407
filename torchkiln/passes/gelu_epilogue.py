"""GELU in the GEMM's epilogue on CUDA: gelu(linear(x, w, b)) as one cuBLASLt call.

Hand-written because inductor leaves it out: it calls cuBLAS for the GEMM (faster there than its
Triton templates: bert-base under max-autotune measured 3-4% slower) and runs bias + GELU as a
separate kernel that reads and writes the 4x-wide FFN activation again, 0.44 ms of a 3.2 ms
bert-base bs64 call on the H200. cuBLASLt applies bias and GELU in the epilogue
(``torch._addmm_activation(..., use_gelu=True)``), but inductor decomposes that op, so it is
wrapped in a custom op and substituted for the pattern in the graph dynamo captures (inductor's
pre-grad pass), before freezing and lowering.

Numerics: cuBLASLt's GELU is the tanh approximation, at most ~5e-4 from the exact erf form that
e.g. BERT uses; half precision's own rounding is ~4e-3 relative, so the plan uses it for
bf16/fp16 only, and the guard checks the result. H200, bert-base bf16, torchkiln's recipe with and
without it, interleaved (benchmarks/diag_gelu_epilogue.py): bs64 3.47 -> 3.12 ms, bs1 0.78 -> 0.71
ms (CUDA graphs), error against float32 9.1e-3 -> 8.8e-3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .registry import CountingPass, register_graph_only


@torch.library.custom_op("torchkiln::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, approximate: str) -> torch.Tensor:
    if x.is_cuda and x.dtype == w.dtype == b.dtype and w.dim() == 2:  # the tanh form, whatever was asked
        out = torch._addmm_activation(b, x.reshape(-1, x.shape[-1]), w.t(), use_gelu=True)
        return out.view(*x.shape[:-1], w.shape[0])
    return F.gelu(F.linear(x, w, b), approximate=approximate)  # elsewhere: the pattern as written


@linear_gelu.register_fake
def _(x, w, b, approximate):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _setup(ctx, inputs, output):
    x, w, b, approximate = inputs
    ctx.save_for_backward(x, w, b)
    ctx.approximate = approximate


def _backward(ctx, grad):
    # A served model is for inference, but gradients through it (e.g. to the input, for saliency)
    # work in eager, so they must here: the pattern's own derivative, from the recomputed GEMM.
    x, w, b = ctx.saved_tensors
    x2 = x.reshape(-1, x.shape[-1])
    dh = torch.ops.aten.gelu_backward(grad.reshape(-1, w.shape[0]), F.linear(x2, w, b), approximate=ctx.approximate)
    dx = (dh @ w).view(x.shape) if ctx.needs_input_grad[0] else None
    dw = dh.t() @ x2 if ctx.needs_input_grad[1] else None
    db = dh.sum(0) if ctx.needs_input_grad[2] else None
    return dx, dw, db, None


linear_gelu.register_autograd(_backward, setup_context=_setup)


_GELU = (torch._C._nn.gelu, F.gelu)
_LINEAR = (torch._C._nn.linear, F.linear)


def _fusable(g) -> bool:
    if g.op != "call_function" or g.target not in _GELU or len(g.args) != 1:
        return False
    if set(g.kwargs) - {"approximate"} or g.kwargs.get("approximate", "none") not in ("none", "tanh"):
        return False
    lin = g.args[0]
    return (isinstance(lin, torch.fx.Node) and lin.op == "call_function" and lin.target in _LINEAR
            and len(lin.users) == 1 and len(lin.args) == 3 and lin.args[2] is not None and not lin.kwargs)


def fuse(graph: torch.fx.Graph) -> int:
    """Rewrites gelu(linear(x, w, b)) in a dynamo graph; returns how many."""
    n = 0
    for g in list(graph.nodes):
        if not _fusable(g):
            continue
        lin = g.args[0]
        with graph.inserting_before(g):
            new = graph.call_function(torch.ops.torchkiln.linear_gelu.default,
                                      (*lin.args, g.kwargs.get("approximate", "none")))
        new.meta.update(g.meta)
        g.replace_all_uses_with(new)
        graph.erase_node(g)
        graph.erase_node(lin)
        n += 1
    return n


class GeluEpiloguePass(CountingPass):
    """The inductor pre-grad hook."""

    source = __file__
    rewrite = staticmethod(fuse)


@dataclass(frozen=True)
class GeluEpilogueConfig:
    name: ClassVar[str] = "gelu_epilogue"


register_graph_only(GeluEpilogueConfig, 90, "in the compiled graph", lambda config: GeluEpiloguePass())
