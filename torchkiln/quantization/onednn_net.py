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
model with the reason; what follows the dequantize (a classifier head) runs as the lowered graph has
it. One program per input shape (MAX_SIGNATURES, as the other traced candidates).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ..kernels import onednn_net as kernel
from ..passes.onednn_graph import MAX_SIGNATURES, PerSignature, Unsupported, _Bound, tensor_leaves
from .onednn_int8 import available as _int8_available
from .onednn_int8 import lower, onednn_engine

aten = torch.ops.aten


def why_not() -> str | None:
    """None where the runner can be built and run here; else why not."""
    if not _int8_available():
        return "this torch build has no oneDNN quantized engine"
    lib = kernel.load()
    return lib if isinstance(lib, str) else None


def available() -> bool:
    return why_not() is None


@dataclass
class _Conv:
    src: int
    other: int | None
    weight: torch.Tensor  # int8 codes, OIHW
    wscale: torch.Tensor  # float32, one per output channel
    bias: torch.Tensor | None
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int
    scale: float
    zp: int
    relu: bool


@dataclass
class _Pool:
    src: int
    avg: bool
    kernel: tuple | None  # None: adaptive, to `size`
    stride: tuple | None
    padding: tuple
    ceil: bool = False
    size: tuple | None = None


@dataclass
class Program:
    """The int8 region as a list of steps over value slots (0: the quantized input; step i makes
    slot i + 1); built into a C net per input shape by ``Net``."""

    scale: float
    zp: int
    steps: list = field(default_factory=list)
    out: int = 0
    flat: bool = False


def _conv_step(m: nn.Module, src: int, other: int | None) -> _Conv:
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
    if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        scales, zps = w.q_per_channel_scales(), w.q_per_channel_zero_points()
    else:
        scales, zps = torch.full((w.shape[0],), w.q_scale()), torch.tensor([w.q_zero_point()])
    if bool(zps.any()):
        raise Unsupported("an int8 weight with a nonzero zero point (oneDNN's are symmetric)")
    bias = m.bias()
    return _Conv(src, other, w.int_repr().contiguous(), scales.float().contiguous(),
                 None if bias is None else bias.detach().float().contiguous(), tuple(m.stride), tuple(m.padding),
                 tuple(m.dilation), int(m.groups), float(m.scale), int(m.zero_point), relu)


def _pool_step(node: fx.Node, src: int) -> _Pool:
    if node.target is aten.adaptive_avg_pool2d.default:
        return _Pool(src, True, None, None, (0, 0), size=tuple(node.args[1]))
    a = list(node.args) + [None] * 6
    kernel_size, stride, padding = tuple(a[1]), tuple(a[2] or a[1]), tuple(a[3] or (0, 0))
    dilation, ceil = tuple(a[4] or (1, 1)), bool(a[5])
    if len(kernel_size) != 2 or len(stride) != 2 or len(padding) != 2 or dilation != (1, 1):
        raise Unsupported(f"max_pool2d{tuple(node.args[1:])}: 2-D windows without dilation only")
    return _Pool(src, False, kernel_size, stride, padding, ceil)


def program(gm: fx.GraphModule) -> tuple[Program, fx.Node, fx.Node, list[fx.Node]]:
    """The int8 region of a lowered graph: (its program, the float node it quantizes, its dequantize,
    its nodes). Raises Unsupported, naming the node, where the region holds anything else."""
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
    return prog, x, deq, region


class Net:
    """One input shape's C program; frees it with the object."""

    def __init__(self, lib, prog: Program, shape: tuple):
        self.lib, self.handle = lib, lib.kn_new()
        self.lock = threading.Lock()  # a net's buffers serve one call at a time
        try:
            self.out_shape = self._build(prog, shape)
            self._check(lib.kn_finalize(self.handle))
        except Exception:
            lib.kn_free(self.handle)
            self.handle = None
            raise

    def _check(self, rc):
        if rc < 0:
            raise Unsupported(f"oneDNN: {self.lib.kn_error(self.handle).decode()}")
        return rc

    def _build(self, prog: Program, shape: tuple) -> tuple:
        lib, h, ints = self.lib, self.handle, kernel.ints
        if len(shape) != 4:
            raise Unsupported(f"an input of shape {shape} (N, C, H, W only)")
        ids, dims = [self._check(lib.kn_input(h, *shape, prog.scale, prog.zp))], [tuple(shape)]
        for s in prog.steps:
            n, c, hh, ww = dims[s.src]
            if isinstance(s, _Conv):
                kh, kw = s.weight.shape[2:]
                (ph, pw), (sh, sw), (dh, dw) = s.padding, s.stride, s.dilation
                out = (n, s.weight.shape[0], (hh + 2 * ph - dh * (kh - 1) - 1) // sh + 1,
                       (ww + 2 * pw - dw * (kw - 1) - 1) // sw + 1)
                other = -1 if s.other is None else ids[s.other]
                bias = None if s.bias is None else s.bias.data_ptr()
                ids.append(self._check(lib.kn_conv(h, ids[s.src], other, s.weight.shape[0], kh, kw, ints(sh, sw),
                                                   ints(ph, pw, ph, pw), ints(dh, dw), s.groups, s.weight.data_ptr(),
                                                   s.wscale.data_ptr(), bias, s.scale, s.zp, int(s.relu))))
            else:
                if s.kernel is None:
                    oh, ow = s.size
                    if hh % oh or ww % ow:
                        raise Unsupported(f"adaptive_avg_pool2d from {(hh, ww)} to {(oh, ow)} (divisors only)")
                    k, st, pad = (hh // oh, ww // ow), (hh // oh, ww // ow), (0, 0)
                else:
                    k, st, pad = s.kernel, s.stride, s.padding
                    oh, ow = (_pooled(hh, k[0], st[0], pad[0], s.ceil), _pooled(ww, k[1], st[1], pad[1], s.ceil))
                ids.append(self._check(lib.kn_pool(h, ids[s.src], int(s.avg), ints(*k), ints(*st), ints(*pad),
                                                   oh, ow)))
                out = (n, c, oh, ow)
            dims.append(out)
        n, c, hh, ww = dims[prog.out]
        if prog.flat and hh * ww != 1:
            raise Unsupported(f"a flatten of an int8 value with spatial size {(hh, ww)} (1 x 1 only)")
        self._check(lib.kn_output(h, ids[prog.out], int(prog.flat)))
        return (n, c) if prog.flat else (n, c, hh, ww)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(self.out_shape)
        with self.lock:
            rc = self.lib.kn_run(self.handle, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()))
        if rc < 0:
            raise RuntimeError(f"torchkiln oneDNN int8 net: {self.lib.kn_error(self.handle).decode()}")
        return out

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.kn_free(self.handle)
            self.handle = None


def _pooled(size: int, k: int, s: int, p: int, ceil: bool) -> int:
    """torch's pooled size (ceil mode: a last window must start inside the input or its left padding)."""
    out = (size + 2 * p - k + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


class Runner(nn.Module):
    """The int8 region in the rewritten graph: float32 NCHW in, the dequantized output out."""

    def __init__(self, prog: Program):
        super().__init__()
        self.prog, self.nets = prog, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise Unsupported(f"an input of {x.dtype} on {x.device} (float32 on the CPU only)")
        net = self.nets.get(tuple(x.shape))
        if net is None:
            lib = kernel.load()
            if isinstance(lib, str):
                raise Unsupported(lib)
            net = self.nets[tuple(x.shape)] = Net(lib, self.prog, tuple(x.shape))
        return net(x)


def rewrite(gm: fx.GraphModule) -> fx.GraphModule:
    """The lowered graph ``gm`` (changed in place) with its int8 region replaced by one Runner call."""
    prog, x, deq, region = program(gm)
    gm.add_submodule("int8_net", Runner(prog))
    with gm.graph.inserting_before(deq):
        call = gm.graph.call_module("int8_net", (x,))
    deq.replace_all_uses_with(call)
    for node in reversed(region):
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


class OneDNNNet(PerSignature):
    """Calls a tk.quantize'd (pt2e) CNN with its int8 trunk as one oneDNN program per input shape."""

    def __init__(self, qmodel: nn.Module, max_signatures: int = MAX_SIGNATURES):
        why = why_not()
        if why:
            raise Unsupported(why)
        gm = getattr(qmodel, "graph", None)
        if not isinstance(gm, fx.GraphModule):
            raise Unsupported(f"{type(qmodel).__name__} is not a pt2e-quantized model (tk.quantize's graph)")
        super().__init__(qmodel, max_signatures)
        self.rewritten = rewrite(lower(gm))

    def _scope(self):
        return onednn_engine()  # the head's quantized linear was packed for it

    def _trace(self, args, kwargs):
        fn = _Bound(self.rewritten, args, kwargs)
        with torch.no_grad(), onednn_engine(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
            fn(*tensor_leaves(args, kwargs))
        return fn


__all__ = ["Net", "OneDNNNet", "Program", "Runner", "Unsupported", "available", "program", "rewrite", "why_not"]
