"""Serving a float32 or bf16 CPU conv net's trunk as one oneDNN program (``kernels/onednn_net.cpp``),
its 3x3 stride-1 convolutions as Winograd F(4x4, 3x3) or F(2x2, 3x3) where that times faster: a
candidate beside the oneDNN Graph trace (onednn_graph.py), timed against it and served only where
faster and within the guard.

Why: on CPU resnet50 the oneDNN Graph trace and IPEX 2.8 run the same direct convolution kernels at
the same speed, near this machine's FMA rate (RESULTS.md, "Where resnet50's time goes against IPEX
2.8"), so fusion alone cannot beat IPEX there. Winograd does the 3x3 convolutions' work with fewer
multiplies (onednn_net.cpp says where it pays); oneDNN 3.x has no CPU Winograd, so the runner
hand-writes its transforms and calls oneDNN's matmul for the GEMMs. The program holds the whole
trunk, so the convolutions, pooling and residual adds run from C without TorchScript's per-op work.

What it reads (the model itself is never changed): ``torch.fx.symbolic_trace`` of the model, or,
where that fails (a shape check or any other Python branch on a tensor, as in every transformers
vision model), ``torch.export`` (non-strict) at each input shape's first call, whose ATen graph turns
the same branches into guards. From either graph it takes the region that starts at the model's first
input and is made of 2-D convolutions (zero, numeric padding; an explicit zero pad before one, as
transformers' TF "same" padding, becomes its padding), an eval BatchNorm right after a convolution
(folded into it), ReLU or a clamp to two numbers (ReLU6, Hardtanh) right after a convolution or its
residual add, an add of two region values where one is a convolution's output read only there
(oneDNN's sum post-op), max pooling, average pooling to a divisor of the size (adaptive, or a mean
over H and W), and identities (``nn.Identity``, eval dropout and its decomposed clone, the value part
of ATen's tuple-returning batch norm and pooling). The values the region hands to the rest of the
graph are the program's outputs; where that is one global pool flattened into one Linear (a
classifier head), the head joins the program (_head); any other head runs as the graph has it
(after a bf16 program, on bf16 copies). Anything else refuses the model with the reason, as does a
region holding too little of the model, and the other candidates serve it.
"""

from __future__ import annotations

import copy
import functools
import operator

import torch
from torch import fx, nn

from .. import inputs
from ..kernels import onednn_net as kernel
from ..kernels.onednn_net import Conv, Linear, Pool, Program, Runner, Scale
from .fxargs import call_args, pair
from .onednn_graph import MAX_SIGNATURES, PerSignature, Unsupported, _Bound, tensor_leaves

# Whether 3x3 convolutions may run as Winograd (each still only where it timed faster). False keeps
# oneDNN's direct kernels, whose sums round as eager's do to within 5e-7 of the output's norm on
# resnet50 (Winograd: 7e-7; the guard's float32 bound is 1e-4).
WINOGRAD = True
aten = torch.ops.aten
_RELU = {torch.relu, torch.relu_, nn.functional.relu, aten.relu.default, aten.relu_.default}
_ADD = {operator.add, operator.iadd, torch.add, aten.add.Tensor, aten.add_.Tensor}
_BN = {aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default}
_MAX_POOL = {aten.max_pool2d.default, aten.max_pool2d_with_indices.default}
# ATen ops returning (value, extras): their getitem 0 is the value, the extras are unused in eval
_TUPLES = {aten._native_batch_norm_legit_no_training.default, aten.max_pool2d_with_indices.default}
_CLIPS = {nn.functional.hardtanh, aten.hardtanh.default, aten.hardtanh_.default, aten.clamp.default}
_PADS = {nn.functional.pad, aten.pad.default, aten.constant_pad_nd.default}
_CONV = {aten.conv2d.default, aten.conv2d.padding, aten.convolution.default}
_ELTWISE = {nn.functional.silu: "silu", aten.silu.default: "silu", aten.silu_.default: "silu", torch.sigmoid: "sigmoid",
            aten.sigmoid.default: "sigmoid", aten.sigmoid_.default: "sigmoid"}
_MUL = {operator.mul, torch.mul, aten.mul.Tensor}


def why_not() -> str | None:
    """None where the runner can be built and run here; else why not."""
    lib = kernel.load()
    return lib if isinstance(lib, str) else None


def _is(node: fx.Node, gm: fx.GraphModule, *types) -> nn.Module | None:
    if node.op != "call_module":
        return None
    m = gm.get_submodule(node.target)
    return m if type(m) in types else None


def _tensor(gm: fx.GraphModule, node: fx.Node, value, what: str) -> torch.Tensor | None:
    """The parameter or buffer an ATen node reads as ``what`` (None stays None)."""
    if value is None:
        return None
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        raise Unsupported(f"{node.name}: its {what} is computed in the graph (the model's own tensors only)")
    return functools.reduce(getattr, value.target.split("."), gm)


def _global_mean(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A mean over H and W keeping them (ATen's decomposed adaptive_avg_pool2d(x, 1))."""
    if node.op != "call_function" or node.target is not aten.mean.dim:
        return False
    a = call_args(node)
    return a["keepdim"] and a["dtype"] is None and sorted(d % 4 for d in a["dim"]) == [2, 3]


def _clip_range(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """(lo, hi) of a clamp to two numbers (ReLU6, Hardtanh, ATen's hardtanh and clamp), else None."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return (float(m.min_val), float(m.max_val)) if type(m) in (nn.ReLU6, nn.Hardtanh) else None
    if node.op != "call_function":
        return None
    if node.target is nn.functional.relu6:
        return 0.0, 6.0
    if node.target not in _CLIPS:
        return None
    a = call_args(node)
    lo, hi = a.get("min_val", a.get("min")), a.get("max_val", a.get("max"))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi))
    return (float(lo), float(hi)) if numbers and lo <= hi else None


def _pad_amounts(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """(top, left, bottom, right) of a zero pad of H and W (nn.ZeroPad2d / ConstantPad2d(0), F.pad,
    ATen's pad and constant_pad_nd), else None."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if type(m) not in (nn.ZeroPad2d, nn.ConstantPad2d) or m.value != 0:
            return None
        pad, mode, value = m.padding, "constant", 0
    elif node.op == "call_function" and node.target in _PADS:
        a = call_args(node)
        pad, mode, value = a["pad"], a.get("mode", "constant"), a.get("value")
    else:
        return None
    if mode != "constant" or value not in (None, 0) or len(pad) != 4 or not all(isinstance(p, int) and p >= 0
                                                                                 for p in pad):
        return None
    left, right, top, bottom = pad  # the last dimension's first
    return top, left, bottom, right


def _eltwise(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """"silu" or "sigmoid" for a SiLU or sigmoid call, else None."""
    if node.op == "call_module":
        return {nn.SiLU: "silu", nn.Sigmoid: "sigmoid"}.get(type(gm.get_submodule(node.target)))
    if node.op == "call_method":
        return {"sigmoid": "sigmoid", "sigmoid_": "sigmoid"}.get(node.target)
    return _ELTWISE.get(node.target) if node.op == "call_function" else None


def _kind(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """What a node is to the program, or None (it is not one of the region's ops)."""
    fn = node.target if node.op == "call_function" else None
    if _is(node, gm, nn.Conv2d) or fn in _CONV:
        return "conv"
    if _is(node, gm, nn.BatchNorm2d) or fn in _BN:
        return "bn"
    if _is(node, gm, nn.ReLU) or fn in _RELU or (node.op == "call_method" and node.target in ("relu", "relu_")):
        return "relu"
    if fn in _ADD or (node.op == "call_method" and node.target in ("add", "add_")):
        return "add"
    if _clip_range(node, gm) is not None:
        return "clip"
    if _eltwise(node, gm) is not None:
        return "eltwise"
    if fn in _MUL or (node.op == "call_method" and node.target == "mul"):
        return "mul"
    if _pad_amounts(node, gm) is not None:
        return "pad"
    if _is(node, gm, nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.AvgPool2d) or fn in _MAX_POOL or fn in (
            aten.adaptive_avg_pool2d.default, nn.functional.adaptive_avg_pool2d, aten.avg_pool2d.default) \
            or _global_mean(node, gm):
        return "pool"
    if _is(node, gm, nn.Identity, nn.Dropout) or fn in (aten.dropout.default, aten.clone.default) or (
            fn is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target in _TUPLES
            and node.args[1] == 0):
        return "alias"
    return None


def _values(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` reads, less the parameters an ATen graph reads by get_attr."""
    return [a for a in node.all_input_nodes if a.op != "get_attr"]


class _Walk:
    """The program made by walking the graph once; ``tail[slot]``: the node holding that slot's
    value now (a convolution's slot moves on to its BatchNorm, ReLU and add nodes as they fold in)."""

    def __init__(self, gm: fx.GraphModule, x: fx.Node, dtype: str):
        self.gm, self.prog = gm, Program(dtype=dtype)
        self.slot: dict[fx.Node, int] = {x: 0}
        self.tail: dict[int, fx.Node] = {0: x}
        self.region: list[fx.Node] = []
        self.folded = 0  # BatchNorms folded into convolutions
        self.pads: dict[fx.Node, tuple] = {}  # a zero pad's node -> (t, l, b, r): its convolutions take it

    def fusable(self, node: fx.Node, value: fx.Node) -> Conv | None:
        """The convolution step ``node`` may fold into: ``value`` is a convolution's current output,
        read by ``node`` alone."""
        s = self.slot[value]
        step = self.prog.steps[s - 1] if s > 0 else None
        if isinstance(step, Conv) and self.tail[s] is value and len(value.users) == 1:
            return step
        return None

    def fold(self, node: fx.Node, value: fx.Node):
        self.slot[node] = self.slot[value]
        self.tail[self.slot[node]] = node

    def add_step(self, node: fx.Node, step):
        self.prog.steps.append(step)
        self.slot[node] = len(self.prog.steps)
        self.tail[self.slot[node]] = node

    def take(self, node: fx.Node, kind: str):
        """Adds ``node`` to the program, or raises Unsupported naming it."""
        args = [a for a in node.args if isinstance(a, fx.Node)]
        if kind != "conv" and any(a in self.pads for a in args):
            raise Unsupported(f"{node.name}: reads a zero-padded value (only a convolution takes one, as its padding)")
        if kind == "conv":
            weight, bias, stride, padding, dilation, groups = self._conv(node)
            bias = None if bias is None else bias.detach().float()
            if args[0] in self.pads:  # an explicit zero pad before it (TF "same" padding) is its padding
                t, left, b, r = self.pads[args[0]]
                pt, pl, pb, pr = padding if len(padding) == 4 else (*padding, *padding)
                padding = (pt + t, pl + left, pb + b, pr + r)
            self.add_step(node, Conv(self.slot[args[0]], None, weight.detach().float(), None, bias, stride, padding,
                                     dilation, groups, 1.0, 0, False))
        elif kind == "bn":
            mean, var, weight, bias, eps, training = self._bn(node)
            step = self.fusable(node, args[0])
            if step is None or step.activated() or step.other is not None or training or var is None:
                raise Unsupported(f"{node.name}: a BatchNorm2d not right after a convolution, or in training mode")
            k = (var + eps).rsqrt() * (1.0 if weight is None else weight)
            before = step.bias if step.bias is not None else torch.zeros_like(mean)
            step.weight = (step.weight * k.reshape(-1, 1, 1, 1)).detach().float()
            step.bias = ((before - mean) * k + (0.0 if bias is None else bias)).detach().float()
            self.folded += 1
            self.fold(node, args[0])
        elif kind == "relu":
            step = self.fusable(node, args[0])
            if step is None or step.activated() or len(node.args) != 1 or set(node.kwargs) - {"inplace"}:
                raise Unsupported(f"{node.name}: a ReLU not right after a convolution or its residual add")
            step.relu = True
            self.fold(node, args[0])
        elif kind == "eltwise":
            step = self.fusable(node, args[0])
            if step is None or step.activated() or len(args) != 1 or set(node.kwargs) - {"inplace"}:
                raise Unsupported(f"{node.name}: a SiLU or sigmoid not right after a convolution or its residual add")
            step.eltwise = _eltwise(node, self.gm)
            self.fold(node, args[0])
        elif kind == "mul":
            if len(args) != 2 or len(node.args) != 2 or node.kwargs or any(a not in self.slot for a in args):
                raise Unsupported(f"{node.name}: a product of other than two of the region's tensors")
            self.add_step(node, Scale(self.slot[args[0]], self.slot[args[1]]))
        elif kind == "clip":
            step = self.fusable(node, args[0])
            if step is None or step.activated() or len(args) != 1:
                raise Unsupported(f"{node.name}: a clamp (ReLU6) not right after a convolution or its residual add")
            step.clip = _clip_range(node, self.gm)
            self.fold(node, args[0])
        elif kind == "pad":
            self.slot[node] = self.slot[args[0]]  # the unpadded value: the convolutions reading it pad it
            self.pads[node] = _pad_amounts(node, self.gm)
        elif kind == "add":
            if len(args) != 2 or len(node.args) != 2 or set(node.kwargs) - {"alpha"} or \
                    node.kwargs.get("alpha", 1) != 1 or any(a not in self.slot for a in args):
                raise Unsupported(f"{node.name}: an add of other than two of the region's tensors")
            if (node.target in (operator.iadd, aten.add_.Tensor, "add_")) and len(args[0].users) != 1:
                raise Unsupported(f"{node.name}: an in-place add to a value read again elsewhere")
            # the later convolution takes the sum: the other operand must exist when it runs
            a, b = sorted(args, key=lambda v: self.slot[v], reverse=True)
            step = self.fusable(node, a)
            if step is None or step.activated() or step.other is not None or self.slot[b] == self.slot[a]:
                raise Unsupported(f"{node.name}: an add whose later operand is not a convolution's output")
            step.other = self.slot[b]
            self.fold(node, a)
        elif kind == "pool":
            self.add_step(node, self._pool(node, self.slot[args[0]]))
        else:  # alias: the value passes through unchanged
            m = self.gm.get_submodule(node.target) if node.op == "call_module" else None
            if (m is not None and m.training) or (node.target is aten.dropout.default and call_args(node)["train"]):
                raise Unsupported(f"{node.name}: a Dropout in training mode")
            s = self.slot[args[0]]
            if self.tail[s] is args[0] and len(args[0].users) == 1:
                self.fold(node, args[0])  # a ReLU or add after it may still fuse into the convolution
            else:
                self.slot[node] = s
        self.region.append(node)

    def _conv(self, node: fx.Node) -> tuple:
        """(weight, bias, stride, padding, dilation, groups) of an nn.Conv2d or ATen convolution."""
        if node.op == "call_module":
            m = self.gm.get_submodule(node.target)
            if m.padding_mode != "zeros":
                raise Unsupported(f"{node.name}: Conv2d with padding_mode={m.padding_mode!r} (zero padding only)")
            if len(node.args) != 1 or node.kwargs:
                raise Unsupported(f"{node.name}: a Conv2d called with more than its input")
            weight, bias, stride, padding, dilation, groups = (m.weight, m.bias, pair(m.stride), m.padding,
                                                               pair(m.dilation), m.groups)
        else:
            a = call_args(node)
            weight = _tensor(self.gm, node, a["weight"], "weight")
            if a.get("transposed") or weight.dim() != 4:
                raise Unsupported(f"{node.name}: a convolution other than a 2-D one")
            bias, stride, padding = _tensor(self.gm, node, a["bias"], "bias"), pair(a["stride"]), a["padding"]
            dilation, groups = pair(a["dilation"]), a["groups"]
        if padding == "same":  # torch's: the odd one out at the bottom and right
            th, tw = (d * (k - 1) for d, k in zip(dilation, weight.shape[2:], strict=True))
            padding = (th // 2, tw // 2, th - th // 2, tw - tw // 2)
        return weight, bias, stride, (0, 0) if padding == "valid" else pair(padding), dilation, groups

    def _bn(self, node: fx.Node) -> tuple:
        """(running mean, running var, weight, bias, eps, training) of an nn.BatchNorm2d or ATen batch norm."""
        if node.op == "call_module":
            m = self.gm.get_submodule(node.target)
            affine = m.weight if m.affine else None, m.bias if m.affine else None
            return m.running_mean, m.running_var, *affine, m.eps, m.training
        a = call_args(node)
        t = {k: _tensor(self.gm, node, a[k], k) for k in ("running_mean", "running_var", "weight", "bias")}
        return t["running_mean"], t["running_var"], t["weight"], t["bias"], a["eps"], a.get("training", False)

    def _pool(self, node: fx.Node, src: int) -> Pool:
        m = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(m, nn.AdaptiveAvgPool2d) or node.target in (aten.adaptive_avg_pool2d.default,
                                                                   nn.functional.adaptive_avg_pool2d):
            size = pair(m.output_size if m is not None else call_args(node)["output_size"])
            if None in size:
                raise Unsupported(f"{node.name}: AdaptiveAvgPool2d to {size} (sizes only)")
            return Pool(src, True, None, None, (0, 0), size=size)
        if m is None and node.target is aten.mean.dim:
            return Pool(src, True, None, None, (0, 0), size=(1, 1))
        if isinstance(m, nn.AvgPool2d) or node.target is aten.avg_pool2d.default:
            a = vars(m) if m is not None else call_args(node)
            kernel_size, stride, padding = pair(a["kernel_size"]), pair(a["stride"] or a["kernel_size"]), a["padding"]
            # oneDNN's average excludes the padding; with none, torch's count_include_pad is the same
            if (pair(padding) != (0, 0) and a["count_include_pad"]) or a["divisor_override"]:
                raise Unsupported(f"{node.name}: average pooling counting its padding, or with a divisor override")
            return Pool(src, True, kernel_size, stride, pair(padding), bool(a["ceil_mode"]))
        if m is not None:
            if m.return_indices:
                raise Unsupported(f"{node.name}: MaxPool2d returning indices")
            kernel_size, stride, padding, dilation, ceil = m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode
        else:
            a = call_args(node)
            kernel_size, stride, padding, dilation, ceil = (a["kernel_size"], a["stride"], a["padding"], a["dilation"],
                                                            a["ceil_mode"])
        if pair(dilation) != (1, 1):
            raise Unsupported(f"{node.name}: max pooling with dilation")
        return Pool(src, False, pair(kernel_size), pair(stride or kernel_size), pair(padding), bool(ceil))


def trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace(model)``; Unsupported where it cannot."""
    try:
        return fx.symbolic_trace(model)
    except Exception as e:  # control flow on tensors, an untraceable module: torch.export may still
        raise Unsupported(f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}") from e


def exported(model: nn.Module, args, kwargs) -> fx.GraphModule:
    """``model``'s ATen graph at these inputs, by non-strict ``torch.export`` (called like the model);
    Unsupported where it cannot be had."""
    try:
        return torch.export.export(model, tuple(args), dict(kwargs), strict=False).module()
    except Exception as e:  # a data-dependent branch, an op export cannot trace: another candidate serves it
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise Unsupported(f"torch.export cannot trace {type(model).__name__}: {type(e).__name__}: {first[:300]}") from e


def program(gm: fx.GraphModule, winograd: int = 1, dtype: str = "float32") -> tuple[Program, list, _Walk]:
    """The conv region of ``gm`` (an fx trace or an exported module; read, not changed): (its program,
    the nodes whose values the program returns, in graph order, the walk that made it: its region's
    nodes, BatchNorms folded). Raises Unsupported, naming the node, where it cannot be held."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        raise Unsupported("the model takes no input")
    x = placeholders[0]
    walk = _Walk(gm, x, dtype)
    with torch.no_grad():  # BatchNorm folding computes new weights from the model's
        for node in gm.graph.nodes:
            values = _values(node)
            if node.op == "placeholder" or not any(a in walk.slot for a in values):
                continue
            kind = _kind(node, gm)
            if kind is not None and all(a in walk.slot for a in values):
                walk.take(node, kind)
    prog = walk.prog
    held = sum(isinstance(s, Conv) for s in prog.steps)
    if not held:
        raise Unsupported("no convolution reads the model's first input")
    # A program of a stem alone (a ConvNeXt's or Swin's patch embedding, a U-Net's first block) leaves
    # the rest of the model to run op by op outside it, uncompiled; it never timed faster (the U-Net's:
    # 19.8 ms against the compiled candidate's 8.6, RESULTS.md), so it is not offered
    total = sum(_kind(n, gm) == "conv" for n in gm.graph.nodes)
    ops = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")
           and n.target is not operator.getitem and n.target != "_guards_fn"]
    taken = sum(n.target is not operator.getitem for n in walk.region)
    if 2 * held < total or 4 * taken < len(ops):
        raise Unsupported(f"the conv region holds {held} of the model's {total} convolutions and {taken} of its "
                          f"{len(ops)} ops (half the convolutions and a quarter of the ops at least)")
    # torch.export's input guard (``_guards_fn``) reads the input and stays: it checks its shape
    inside = set(walk.region) | {x} | {n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    outs = sorted({a for n in gm.graph.nodes if n not in inside for a in n.all_input_nodes if a in walk.slot},
                  key=order.get)
    if x in outs:
        raise Unsupported("the model reads its input outside the conv region")
    if any(o in walk.pads for o in outs):
        raise Unsupported("a zero-padded value leaves the conv region (only a convolution takes one)")
    if len(outs) == 1:
        outs = [_head(gm, walk, outs[0])]
    prog.out = walk.slot[outs[0]] if len(outs) == 1 else tuple(walk.slot[o] for o in outs)
    prog.winograd = winograd
    return prog, outs, walk


def _flattens(node: fx.Node, gm: fx.GraphModule, value: fx.Node) -> bool:
    """``node`` flattens ``value``, a (N, C, 1, 1) global pool, to (N, C)."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return type(m) is nn.Flatten and (m.start_dim, m.end_dim) == (1, -1)
    if node.op in ("call_function", "call_method") and node.target in (torch.flatten, "flatten"):
        return not node.kwargs and tuple(node.args) in ((value, 1), (value, 1, -1))
    if node.target is aten.flatten.using_ints:
        a = call_args(node)
        return (a["start_dim"], a["end_dim"]) == (1, -1)
    if node.target in (aten.view.default, aten.reshape.default):  # ATen's decomposed flatten, by shape
        src, out = value.meta.get("val"), node.meta.get("val")
        return src is not None and out is not None and out.dim() == 2 and tuple(out.shape) == tuple(src.shape[:2])
    return False


def _linear(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """(weight, bias, the nodes besides ``node`` it takes) of a Linear on the flattened value: an
    nn.Linear, ATen's linear, or its decomposed addmm(bias, x, permute(weight))."""
    m = _is(node, gm, nn.Linear)
    if m is not None:
        return (m.weight, m.bias, []) if len(node.args) == 1 and not node.kwargs else None
    if node.target is aten.linear.default:
        a = call_args(node)
        return _tensor(gm, node, a["weight"], "weight"), _tensor(gm, node, a["bias"], "bias"), []
    if node.target is aten.addmm.default:
        a = call_args(node)
        t = a["mat2"]
        if a["beta"] != 1 or a["alpha"] != 1 or not isinstance(t, fx.Node) or len(t.users) != 1 or not (
                t.target is aten.t.default or (t.target is aten.permute.default and list(t.args[1]) == [1, 0])):
            return None
        return _tensor(gm, node, t.args[0], "weight"), _tensor(gm, node, a["input"], "bias"), [t]
    return None


def _head(gm: fx.GraphModule, walk: _Walk, last: fx.Node) -> fx.Node:
    """A global average pool's output flattened into one Linear (a classifier head) joins the program:
    then the whole model runs from C, and a bf16 program reads the head's weights in bf16 (resnet50's
    fc is 8 MB in float32, read from memory at every call). Returns the region's new last node."""
    s = walk.slot[last]
    step = walk.prog.steps[s - 1] if s > 0 else None
    if not (isinstance(step, Pool) and step.kernel is None and step.size == (1, 1) and walk.tail[s] is last
            and len(last.users) == 1):
        return last
    (flat,) = last.users
    if not _flattens(flat, gm, last) or len(flat.users) != 1:
        return last
    (lin,) = flat.users
    got = _linear(lin, gm)
    if got is None or [a for a in _values(lin) if a not in got[2]] != [flat]:
        return last
    weight, bias, more = got
    walk.add_step(lin, Linear(s, weight.detach().float(), None if bias is None else bias.detach().float()))
    walk.prog.flat = True
    walk.region += [flat, *more, lin]
    return lin


def rewrite(gm: fx.GraphModule, winograd: int = 1, dtype: str = "float32") -> tuple[fx.GraphModule, _Walk]:
    """``gm`` (the model's own trace or export, changed in place) with its conv region replaced by one
    Runner call; and the walk that found the region."""
    prog, outs, walk = program(gm, winograd, dtype)
    gm.add_submodule("conv_net", Runner(prog))
    # The region reads the input alone, so its call goes right after it (and torch.export's guard),
    # before every node that reads any of its values.
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    guard = [n for n in x.users if n.op == "call_module" and n.target == "_guards_fn"]
    with gm.graph.inserting_after(guard[0] if guard else [n for n in gm.graph.nodes if n.op == "placeholder"][-1]):
        call = gm.graph.call_module("conv_net", (x,))
    if len(outs) == 1:
        outs[0].replace_all_uses_with(call)
    else:  # a tuple of the values, in graph order
        for i, o in enumerate(outs):
            with gm.graph.inserting_after(call):
                item = gm.graph.call_function(operator.getitem, (call, i))
            o.replace_all_uses_with(item)
    for node in reversed(walk.region):
        gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):  # the parameters only the region read (an exported graph's)
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm, walk


def _head_in_bf16(gm: fx.GraphModule) -> fx.GraphModule:
    """What runs after a bf16 program (a classifier the program could not take), on bf16 copies of its
    modules and tensors: in float32 it read twice the bytes, and VGG-11's 480 MB head at batch 1 made the
    bf16 conv net 0.60-0.75x the oneDNN Graph trace of the model cast to bf16 (RESULTS.md)."""
    gm.delete_all_unused_submodules()
    for name, child in list(gm.named_children()):
        if name != "conv_net":  # the program holds its own weights; the others are the model's: copied
            setattr(gm, name, copy.deepcopy(child).to(torch.bfloat16))
    for name, t in list(gm.named_parameters(recurse=False)) + list(gm.named_buffers(recurse=False)):
        if t.is_floating_point():  # a tensor the graph reads by get_attr, held by the graph module itself
            cast = t.detach().to(torch.bfloat16)
            setattr(gm, name, nn.Parameter(cast, requires_grad=False) if isinstance(t, nn.Parameter) else cast)
    return gm


class OneDNNConvNet(PerSignature):
    """Calls a CPU conv net with its trunk as one oneDNN program per input shape, in float32 or
    bfloat16 (``dtype``; answered in the inputs' dtype either way; a head the program could not take
    runs as the model has it, on bf16 copies in bf16). ``winograd``: None follows WINOGRAD; False
    direct kernels only; True each 3x3 convolution's fastest form; 4 or 2 that Winograd form wherever
    it applies (tests). ``notes``: a list the first built shape's account is written into (the report's
    "applied"). A model torch.fx traces is rewritten once, here; any other is exported per input shape
    at its first call."""

    def __init__(self, model: nn.Module, winograd: bool | int | None = None, notes: list | None = None,
                 dtype: torch.dtype = torch.float32, max_signatures: int = MAX_SIGNATURES):
        why = why_not()
        if why:
            raise Unsupported(why)
        if model.training:
            raise Unsupported("the model is in training mode (its BatchNorm statistics would move)")
        if dtype not in (torch.float32, torch.bfloat16):
            raise Unsupported(f"dtype={dtype} (torch.float32 or torch.bfloat16)")
        super().__init__(model, max_signatures)
        self.wino, self.dtype, self.notes = int(WINOGRAD if winograd is None else winograd), dtype, notes
        self.graphs: list[fx.GraphModule] = []  # each rewritten graph; the fx trace's serves every shape
        try:
            gm = trace(model)
        except Unsupported as e:
            self.why_fx = str(e)
        else:
            self.why_fx = None
            self._rewrite(gm)

    def _rewrite(self, gm: fx.GraphModule) -> fx.GraphModule:
        gm, walk = rewrite(gm, self.wino, str(self.dtype).removeprefix("torch."))
        if self.dtype == torch.bfloat16:
            gm = _head_in_bf16(gm)
        if not self.graphs:
            self.folded = walk.folded
        self.graphs.append(gm)
        return gm

    @property
    def rewritten(self) -> fx.GraphModule | None:
        """The first rewritten graph (None before an exported model's first call)."""
        return self.graphs[0] if self.graphs else None

    @property
    def front(self) -> str:
        return "fx" if self.why_fx is None else "torch.export"

    @property
    def convs(self) -> int:
        return sum(isinstance(s, Conv) for s in self.rewritten.conv_net.prog.steps)

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        if self.dtype == torch.float32:
            return out
        # answered in the inputs' floating dtype, as the other cast candidates do (stock.py)
        want = next((t.dtype for t in inputs.flatten((args, kwargs)) if t.is_floating_point()), torch.float32)
        return inputs.tree_map(lambda t: t.to(want) if t.is_floating_point() else t, out)

    def _trace(self, args, kwargs):
        if self.why_fx is None:
            gm = self.graphs[0]
        else:
            try:
                gm = self._rewrite(exported(self.model, args, kwargs))
            except Unsupported as e:
                raise Unsupported(f"{self.why_fx}; {e}") from e
        fn = _Bound(gm, args, kwargs)
        with torch.no_grad():
            fn(*tensor_leaves(args, kwargs))  # builds this shape's program
        if self.notes is not None and not self.notes:
            self.notes.append(self.describe())
        return fn

    def describe(self) -> str:
        wino, dtype = self.winograd(), self.rewritten.conv_net.prog.dtype
        return (f"onednn_conv_net ({dtype}, from {self.front}: {self.convs} convolutions, {self.folded} BatchNorms "
                f"folded; of {len(wino)} 3x3 stride-1, timed fastest: {wino.count(4)} Winograd F(4x4, 3x3), "
                f"{wino.count(2)} F(2x2, 3x3), {wino.count(0)} direct)")

    def winograd(self) -> list[int]:
        """Each built shape's form per eligible convolution (onednn_net.Net.winograd: 4, 2 or 0)."""
        return [c for gm in self.graphs for net in gm.conv_net.nets.values() for c in net.winograd()]


__all__ = ["OneDNNConvNet", "Unsupported", "exported", "program", "rewrite", "trace", "why_not"]
