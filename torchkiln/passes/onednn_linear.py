"""Route nn.Linear through oneDNN with a pre-packed weight.

Why hand-written: on CPUs where torch's BLAS is slow for a dtype (MKL's fp32
sgemm on AMD Zen 5 reaches 174-225 GFLOP/s where oneDNN reaches 448-531 on the
same 2-core machine: benchmarks/micro.py in RESULTS.md), stock torch and inductor's freezing still pick BLAS for fp32
linears. torch exposes the oneDNN kernels inductor itself uses
(mkldnn._linear_pointwise, mkldnn._reorder_linear_weight) but no switch to use
them for fp32; this pass is that switch. The planner enables it only where a
measurement on this machine shows it faster.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..timing import median_seconds
from .registry import CountingPass, register, register_graph
from .sample_run import run_with_linear_hooks

log = logging.getLogger(__name__)


def available(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def hf_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and its family): a linear layer whose weight is stored
    transposed, (in, out), computed as ``addmm(bias, x, weight)``. Looked up among the loaded
    modules, never imported: a model holding one has loaded transformers."""
    utils = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(utils, "Conv1D", None) if utils is not None else None
    return cls is not None and type(m) is cls and m.weight.dim() == 2


def routable(m: nn.Module) -> bool:
    """A layer this pass replaces: an exact nn.Linear, or transformers' Conv1D."""
    return type(m) is nn.Linear or hf_conv1d(m)


class OneDNNLinear(nn.Module):
    """Same parameters as the layer it replaces (an nn.Linear, or transformers' Conv1D, whose
    weight keeps its own (in, out) layout), plus a packed copy of the weight."""

    def __init__(self, linear: nn.Module, batch_hint: int | None = None):
        super().__init__()
        conv1d = hf_conv1d(linear)
        w = linear.weight.detach()
        if conv1d:  # GPT-2's layers: without this, its float32 GEMMs stayed on MKL (gpt2 bs1 1.02x eager)
            w = w.t().contiguous()
        self.out_features, self.in_features = w.shape
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, batch_hint), persistent=False)
        self.packed_dtype = self.packed_weight.dtype  # read per call; a plain attribute is the cheap read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == self.packed_dtype and x.is_contiguous() and \
                not torch.compiler.is_compiling():
            # Eager's common case without the reshapes and copies: a call cost ~12 us more than
            # nn.Linear's at one row (512x512 on a 2-core Zen 4), overhead that bounds small batches.
            # The tensors come from the module's dicts: nn.Module.__getattr__ took 0.6 us a read,
            # three reads a call (2-core Zen 4, thirty-fourth session). Traced, the reshape stays:
            # fuse_activations matches it, and without it inductor's own linear pattern asserts on
            # the packed weight (below).
            return torch.ops.mkldnn._linear_pointwise(x, self._buffers["packed_weight"], self._parameters.get("bias"),
                                                      "none", [], "")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != self.packed_dtype:
            x2 = x2.to(self.packed_dtype)
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed_weight, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def input_rows(model: nn.Module, args: tuple, kwargs: dict) -> dict[nn.Module, int]:
    """Rows (M of the GEMM: batch x sequence for text) each Linear sees in one sample run.
    oneDNN picks the packed layout for an M; packing for the wrong M costs ~10%."""
    rows: dict[nn.Module, int] = {}
    run_with_linear_hooks(model, args, kwargs, lambda name, mod, inp: rows.setdefault(mod, inp.numel() // inp.shape[-1]),
                          select=routable)
    return rows


def onednn_linear(model: nn.Module, rows: dict[nn.Module, int] | None = None) -> nn.Module:
    """Replace every CPU nn.Linear (and transformers Conv1D) whose dtype oneDNN supports. ``rows``
    (from ``input_rows``) tunes each packed layout. Mutates and returns ``model``."""
    rows = rows or {}
    for name, child in list(model.named_children()):
        if routable(child) and child.weight.device.type == "cpu" and available(child.weight.dtype):
            setattr(model, name, OneDNNLinear(child, rows.get(child)))
        else:
            onednn_linear(child, rows)
    return model


def measure(dtype: torch.dtype, m: int, k: int, n: int, iters: int = 10) -> dict[str, float]:
    """GFLOP/s of stock aten linear vs oneDNN packed linear on one shape, this machine, now."""
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
    paths = {
        "aten": lambda: torch.nn.functional.linear(x, w, b),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
    }
    with torch.no_grad():
        return {name: round(2 * m * k * n / median_seconds(fn, iters=iters) / 1e9, 1) for name, fn in paths.items()}


def graph_attr(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads; None for any other node or a non-tensor."""
    if getattr(node, "op", None) != "get_attr":
        return None
    t = gm
    for part in node.target.split("."):
        t = getattr(t, part)
    return t if isinstance(t, torch.Tensor) else None


def graph_float_linears(gm: torch.fx.GraphModule) -> list:
    """The ``aten.linear`` nodes of an exported (pt2e int8) graph whose weight is a float32
    graph attribute: the layers kept in float. A quantized linear's weight comes through a
    dequantize node instead."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.linear.default:
            w = graph_attr(gm, n.args[1])
            if w is not None and w.dtype == torch.float32 and w.dim() == 2:
                out.append(n)
    return out


def onednn_linear_graph(gm: torch.fx.GraphModule) -> int:
    """Route a pt2e int8 graph's float32 linears through OneDNNLinear submodules. Why: inductor's
    freezing packs an exported graph's float32 linears for MKL (torch/_inductor/fx_passes/mkldnn_fusion.py,
    pack_linear; oneDNN only for symbolic sizes, which the attention router's per-shape choice
    specializes away), and MKL's fp32 GEMM is the slow one on AMD CPUs (above). Mutates ``gm``;
    the weights are shared, not copied. Returns how many were routed."""
    nodes = graph_float_linears(gm)
    for i, n in enumerate(nodes):
        w = graph_attr(gm, n.args[1])
        b = graph_attr(gm, n.args[2]) if len(n.args) > 2 else None
        shell = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        shell.weight = nn.Parameter(w.detach(), requires_grad=False)
        shell.bias = nn.Parameter(b.detach(), requires_grad=False) if b is not None else None
        name = f"kiln_onednn_linear_{i}"
        gm.add_submodule(name, OneDNNLinear(shell))
        with gm.graph.inserting_before(n):
            new = gm.graph.call_module(name, (n.args[0],))
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    if nodes:
        gm.recompile()
    return len(nodes)


@dataclass(frozen=True)
class OneDNNLinearConfig:
    """The measurement behind the choice travels with it: GEMM shape (m, k, n) and
    GFLOP/s of each path on this machine (empty when forced by a knob)."""

    name: ClassVar[str] = "onednn_linear"
    shape: tuple[int, ...] = ()
    aten_gflops: float | None = None
    onednn_gflops: float | None = None


@register(OneDNNLinearConfig, order=70)
def _apply(model, config, ctx):
    graph = getattr(model, "graph", None)
    if isinstance(graph, torch.fx.GraphModule) and hasattr(model, "kiln_quant"):  # a tk.quantize'd (pt2e) graph
        return model, f"{onednn_linear_graph(graph)} float32 linears of the int8 graph"
    rows = input_rows(model, *ctx.sample) if ctx.sample is not None else None
    before = sum(isinstance(m, OneDNNLinear) for m in model.modules())
    model = onednn_linear(model, rows)
    n = sum(isinstance(m, OneDNNLinear) for m in model.modules()) - before
    return model, f"{n} linears" + (", packed for the sample's rows" if rows else "")


# Activations oneDNN applies in the GEMM's epilogue (a post-op): the name _linear_pointwise takes.
_POST_OPS = {torch.relu: "relu", F.relu: "relu", F.silu: "swish", torch._C._nn.gelu: "gelu"}


def _post_op(node) -> tuple[str, str] | None:
    """(post-op, algorithm) for an activation node the GEMM before it can apply, or None."""
    if node.op == "call_method" and node.target == "relu":
        name = "relu"
    elif node.op == "call_function":
        name = _POST_OPS.get(node.target)
    else:
        return None
    kwargs = dict(node.kwargs)
    kwargs.pop("inplace", None)  # in place on the GEMM's own output, whose only reader it is (fuse_activations)
    if name is None or len(node.args) != 1:
        return None
    algorithm = kwargs.pop("approximate", "none") if name == "gelu" else ""
    return None if kwargs or algorithm not in ("none", "tanh", "") else (name, algorithm)


def fuse_activations(graph: torch.fx.Graph) -> int:
    """act(reshape(_linear_pointwise(x, w, b, "none", [], ""))), as OneDNNLinear traces, becomes
    reshape(_linear_pointwise(x, w, b, act, [], algorithm)) in a dynamo graph; returns how many.

    Why hand-written: inductor's freezing fuses an activation into the oneDNN linears it packs itself,
    but not into ours. MiniLM fp32 bs16 seq61 on a 2-core Zen 5: GELU ran as its own kernel, 6 x 248 us
    of a 56 ms call (torch.profiler; RESULTS.md, thirtieth session). Calling the op without the reshape
    lets inductor's own pattern fuse it, but then its linear + add pattern asserts on our packed weight
    (torch 2.13, mkldnn_fusion.get_linear_transpose_weight): hence a rewrite before inductor sees it."""
    linears = (torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._linear_pointwise.default)
    n = 0
    for act in list(graph.nodes):
        post = _post_op(act)
        view = act.args[0] if post else None
        if not (isinstance(view, torch.fx.Node) and view.op == "call_method" and view.target == "reshape"
                and len(view.users) == 1):
            continue
        lin = view.args[0]
        if not (isinstance(lin, torch.fx.Node) and lin.op == "call_function" and lin.target in linears
                and len(lin.users) == 1 and len(lin.args) == 6 and lin.args[3] == "none" and not lin.kwargs):
            continue
        lin.args = (*lin.args[:3], post[0], [], post[1])
        act.replace_all_uses_with(view)
        graph.erase_node(act)
        n += 1
    return n


class FuseActivations(CountingPass):
    """The inductor pre-grad hook."""

    source = __file__
    rewrite = staticmethod(fuse_activations)


register_graph(OneDNNLinearConfig)(lambda config: FuseActivations())
