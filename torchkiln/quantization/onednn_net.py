"""Serving a pt2e int8 CNN's convolution trunk as one oneDNN program (``kernels/onednn_net.cpp``):
a candidate beside the int8 modules trace (onednn_int8.py), timed against it and served only where
it is faster and passes the guard.

Why: the int8 modules trace calls torch's quantized conv ops, which run the same oneDNN kernels
but spend 6-20 us per call around each (output allocation, scales, attributes, primitive lookup;
resnet50 bs1 on a 2-core Zen 5: 6.32 ms through the modules, 5.66 ms here, benchmarks/diag_int8_net.py;
RESULTS.md "oneDNN int8 net"). Here every primitive, weight layout and buffer is made once per input
shape, and a call runs the list from C. The numbers are the same quantization: the lowered graph's
modules give the weights (int8 codes, per-channel scales), biases and calibrated scales.

What it takes: the lowered graph's int8 region, from the input's ``quantize_per_tensor`` to one
``dequantize``, made of quantized Conv2d / ConvReLU2d / ConvAdd2d / ConvAddReLU2d modules, max pooling,
adaptive average pooling to a divisor of the size, and a flatten before the dequantize. Anything
else in that region (another quantize, a float op between int8 ones, a second output) refuses the
model with the reason. A classifier head right after the flatten + dequantize (lower()'s DynamicLinear)
joins the program as an int8 matmul on the region's own codes (``_head_step`` says why); anything else
after the dequantize runs as the lowered graph has it. One program per input shape (MAX_SIGNATURES, as
the other traced candidates).
"""

from __future__ import annotations

import warnings

import torch
from torch import fx, nn

from ..kernels import onednn_net as kernel
from ..kernels.onednn_net import Conv, Linear, Net, Pool, Program, Runner
from ..passes.onednn_graph import MAX_SIGNATURES, PerSignature, Unsupported, _Bound, tensor_leaves
from .onednn_int8 import DynamicLinear, lower, onednn_engine
from .onednn_int8 import available as _int8_available

aten = torch.ops.aten


def why_not() -> str | None:
    """None where the runner can be built and run here; else why not."""
    if not _int8_available():
        return "this torch build has no oneDNN quantized engine"
    lib = kernel.load()
    return lib if isinstance(lib, str) else None


def available() -> bool:
    return why_not() is None


def _scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized weight's (scales per output channel, zero points), per-tensor ones broadcast."""
    if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        return w.q_per_channel_scales(), w.q_per_channel_zero_points()
    return torch.full((w.shape[0],), w.q_scale()), torch.tensor([w.q_zero_point()])


def _conv_step(m: nn.Module, src: int, other: int | None) -> Conv:
    import torch.ao.nn.intrinsic.quantized as nniq
    import torch.ao.nn.quantized as nnq

    kinds = {nnq.Conv2d: (False, False), nniq.ConvReLU2d: (True, False), nniq.ConvAdd2d: (False, True),
             nniq.ConvAddReLU2d: (True, True)}
    if type(m) not in kinds:
        raise Unsupported(f"{type(m).__name__} on int8 values (quantized Conv2d, ConvReLU2d, ConvAdd2d, "
                          "ConvAddReLU2d only)")
    relu, add = kinds[type(m)]
    if add != (other is not None):
        raise Unsupported(f"{type(m).__name__} called with {1 + (other is not None)} inputs")
    if m.padding_mode != "zeros":
        raise Unsupported(f"{type(m).__name__} with padding_mode={m.padding_mode!r} (zeros only)")
    w = m.weight()
    scales, zps = _scales(w)
    if bool(zps.any()):
        raise Unsupported("an int8 weight with a nonzero zero point (oneDNN's are symmetric)")
    bias = m.bias()
    return Conv(src, other, w.int_repr().contiguous(), scales.float().contiguous(),
                 None if bias is None else bias.detach().float().contiguous(), tuple(m.stride), tuple(m.padding),
                 tuple(m.dilation), int(m.groups), float(m.scale), int(m.zero_point), relu)


def _pool_step(node: fx.Node, src: int) -> Pool:
    if node.target is aten.adaptive_avg_pool2d.default:
        return Pool(src, True, None, None, (0, 0), size=tuple(node.args[1]))
    a = list(node.args) + [None] * 6
    kernel_size, stride, padding = tuple(a[1]), tuple(a[2] or a[1]), tuple(a[3] or (0, 0))
    dilation, ceil = tuple(a[4] or (1, 1)), bool(a[5])
    if len(kernel_size) != 2 or len(stride) != 2 or len(padding) != 2 or dilation != (1, 1):
        raise Unsupported(f"max_pool2d{tuple(node.args[1:])}: 2-D windows without dilation only")
    return Pool(src, False, kernel_size, stride, padding, ceil)


def _head_step(gm: fx.GraphModule, deq: fx.Node, src: int) -> tuple[Linear, fx.Node] | None:
    """The classifier head right after the region's flatten + dequantize (lower()'s DynamicLinear), as
    the program's int8 Linear on the region's own uint8 codes, or None. Why: inside the program it is
    one oneDNN matmul on the calibrated grid (IPEX runs resnet50's fc so), where the module after the
    program re-quantizes its input per call and costs a torch op call (36-43 us at resnet50 bs1)."""
    users = list(deq.users)
    if len(users) != 1 or users[0].op != "call_module" or users[0].args != (deq,) or users[0].kwargs:
        return None
    m = gm.get_submodule(users[0].target)
    if not isinstance(m, DynamicLinear):
        return None
    w, bias = m.params._weight_bias()
    scales, zps = _scales(w)
    if bool(zps.any()):
        return None
    return Linear(src, w.int_repr().contiguous(), None if bias is None else bias.detach().float().contiguous(),
                  scales.float().contiguous()), users[0]


def program(gm: fx.GraphModule, head: bool = True) -> tuple[Program, fx.Node, fx.Node, list[fx.Node]]:
    """The int8 region of a lowered graph: (its program, the float node it quantizes, the node whose
    value the program gives (the dequantize, or with ``head`` the classifier head after it), its
    nodes). Raises Unsupported, naming the node, where the region holds anything else."""
    q_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.quantize_per_tensor]
    if len(q_nodes) != 1:
        raise Unsupported(f"{len(q_nodes)} input quantizes (one int8 region only)")
    qn = q_nodes[0]
    x, scale, zp, dtype = qn.args
    if dtype != torch.quint8:
        raise Unsupported(f"the input is quantized to {dtype} (quint8 only)")
    prog = Program(float(scale), int(zp))
    slot = {qn: 0}
    region, deq = [qn], None
    for node in gm.graph.nodes:
        reads = [a for a in node.all_input_nodes if a in slot]
        if node is qn or not reads:
            continue
        if deq is not None:
            raise Unsupported(f"{node.name} reads the int8 region after its dequantize")
        if node.op == "call_method" and node.target == "dequantize":
            deq = node
        elif node.op == "call_module":
            args = [slot.get(a) if isinstance(a, fx.Node) else None for a in node.args]
            if None in args or node.kwargs:
                raise Unsupported(f"{node.name} mixes int8 and other inputs")
            prog.steps.append(_conv_step(gm.get_submodule(node.target), args[0], args[1] if len(args) > 1 else None))
        elif node.op == "call_function" and node.target in (aten.max_pool2d.default, aten.adaptive_avg_pool2d.default):
            prog.steps.append(_pool_step(node, slot[node.args[0]]))
        elif node.op == "call_method" and node.target == "clone":  # lower()'s copy of an accumulator:
            slot[node] = slot[node.args[0]]  # the program copies a residual read later itself
            region.append(node)
            continue
        elif node.op == "call_function" and node.target is aten.flatten.using_ints and tuple(node.args[1:]) in ((1,), (1, -1)):
            users = list(node.users)
            if len(users) != 1 or users[0].target != "dequantize":
                raise Unsupported(f"{node.name}: a flatten is taken only right before the dequantize")
            prog.flat = True
            slot[node] = slot[node.args[0]]
            region.append(node)
            continue
        else:
            raise Unsupported(f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)}) on int8 values")
        region.append(node)
        if node is not deq:
            slot[node] = len(prog.steps)
    if deq is None:
        raise Unsupported("the int8 region has no dequantize")
    prog.out = slot[deq.args[0]]
    taken = _head_step(gm, deq, prog.out) if head and prog.flat else None
    if taken is None:
        return prog, x, deq, region
    step, last = taken
    prog.steps.append(step)
    prog.out = len(prog.steps)
    return prog, x, last, [*region, last]


def rewrite(gm: fx.GraphModule, head: bool = True) -> fx.GraphModule:
    """The lowered graph ``gm`` (changed in place) with its int8 region (and, with ``head``, the
    classifier head after it) replaced by one Runner call."""
    prog, x, last, region = program(gm, head)
    gm.add_submodule("int8_net", Runner(prog))
    with gm.graph.inserting_before(last):
        call = gm.graph.call_module("int8_net", (x,))
    last.replace_all_uses_with(call)
    for node in reversed(region):
        gm.graph.erase_node(node)
    gm.delete_all_unused_submodules()  # the packed quantized modules the program now holds
    gm.graph.lint()
    gm.recompile()
    return gm


class OneDNNNet(PerSignature):
    """Calls a tk.quantize'd (pt2e) CNN with its int8 trunk as one oneDNN program per input shape."""

    def __init__(self, qmodel: nn.Module, max_signatures: int = MAX_SIGNATURES, head: bool = True):
        why = why_not()
        if why:
            raise Unsupported(why)
        gm = getattr(qmodel, "graph", None)
        if not isinstance(gm, fx.GraphModule):
            raise Unsupported(f"{type(qmodel).__name__} is not a pt2e-quantized model (tk.quantize's graph)")
        super().__init__(qmodel, max_signatures)
        self.rewritten = rewrite(lower(gm), head)

    def _scope(self):
        return onednn_engine()  # a head left after the program was packed for it

    def _trace(self, args, kwargs):
        fn = _Bound(self.rewritten, args, kwargs)
        with torch.no_grad(), onednn_engine(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
            fn(*tensor_leaves(args, kwargs))
        return fn


__all__ = ["Net", "OneDNNNet", "Program", "Runner", "Unsupported", "available", "program", "rewrite", "why_not"]
