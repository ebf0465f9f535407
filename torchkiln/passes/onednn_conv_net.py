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

What it takes, from ``torch.fx.symbolic_trace`` of the model as given (read, never changed): the
region that starts at the model's first input and is made of ``nn.Conv2d`` (zero padding, numeric
padding), an eval ``nn.BatchNorm2d`` right after a convolution (folded into it), ReLU right after a
convolution or its residual add, an add of two region values where one is a convolution's output
read only there (oneDNN's sum post-op), ``nn.MaxPool2d``, ``nn.AdaptiveAvgPool2d`` to a divisor of
the size, and ``nn.Identity`` / eval ``nn.Dropout``. The region must hand one value to the rest of
the graph: a global pool's flatten into one Linear joins the program (_head); any other head runs as
the traced graph has it (after a bf16 program, on bf16 copies). Anything else refuses the model with
the reason, and the other candidates serve it.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx, nn

from .. import inputs
from ..kernels import onednn_net as kernel
from ..kernels.onednn_net import Conv, Linear, Pool, Program, Runner
from .onednn_graph import MAX_SIGNATURES, PerSignature, Unsupported, _Bound, tensor_leaves

# Whether 3x3 convolutions may run as Winograd (each still only where it timed faster). False keeps
# oneDNN's direct kernels, whose sums round as eager's do to within 5e-7 of the output's norm on
# resnet50 (Winograd: 7e-7; the guard's float32 bound is 1e-4).
WINOGRAD = True
_RELU = {torch.relu, torch.relu_, nn.functional.relu}
_ADD = {operator.add, operator.iadd, torch.add}


def why_not() -> str | None:
    """None where the runner can be built and run here; else why not."""
    lib = kernel.load()
    return lib if isinstance(lib, str) else None


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _is(node: fx.Node, gm: fx.GraphModule, *types) -> nn.Module | None:
    if node.op != "call_module":
        return None
    m = gm.get_submodule(node.target)
    return m if type(m) in types else None


def _kind(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """What a node is to the program, or None (it is not one of the region's ops)."""
    if _is(node, gm, nn.Conv2d):
        return "conv"
    if _is(node, gm, nn.BatchNorm2d):
        return "bn"
    if _is(node, gm, nn.ReLU) or (node.op == "call_function" and node.target in _RELU) or \
            (node.op == "call_method" and node.target in ("relu", "relu_")):
        return "relu"
    if (node.op == "call_function" and node.target in _ADD) or (node.op == "call_method" and node.target in ("add", "add_")):
        return "add"
    if _is(node, gm, nn.MaxPool2d, nn.AdaptiveAvgPool2d):
        return "pool"
    if _is(node, gm, nn.Identity, nn.Dropout):
        return "alias"
    return None


class _Walk:
    """The program made by walking the traced graph once; ``tail[slot]``: the node holding that slot's
    value now (a convolution's slot moves on to its BatchNorm, ReLU and add nodes as they fold in)."""

    def __init__(self, gm: fx.GraphModule, x: fx.Node, dtype: str):
        self.gm, self.prog = gm, Program(dtype=dtype)
        self.slot: dict[fx.Node, int] = {x: 0}
        self.tail: dict[int, fx.Node] = {0: x}
        self.region: list[fx.Node] = []
        self.folded = 0  # BatchNorms folded into convolutions

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
        if kind == "conv":
            m = self.gm.get_submodule(node.target)
            if m.padding_mode != "zeros" or isinstance(m.padding, str):
                raise Unsupported(f"{node.name}: Conv2d with padding={m.padding!r}, padding_mode={m.padding_mode!r} "
                                  "(numeric zero padding only)")
            if len(node.args) != 1 or node.kwargs:
                raise Unsupported(f"{node.name}: a Conv2d called with more than its input")
            bias = None if m.bias is None else m.bias.detach().float()
            self.add_step(node, Conv(self.slot[args[0]], None, m.weight.detach().float(), None, bias, _pair(m.stride),
                                     _pair(m.padding), _pair(m.dilation), m.groups, 1.0, 0, False))
        elif kind == "bn":
            m = self.gm.get_submodule(node.target)
            step = self.fusable(node, args[0])
            if step is None or step.relu or step.other is not None or m.training or m.running_var is None:
                raise Unsupported(f"{node.name}: a BatchNorm2d not right after a convolution, or in training mode")
            k = (m.running_var + m.eps).rsqrt() * (m.weight if m.affine else 1.0)
            bias = step.bias if step.bias is not None else torch.zeros_like(m.running_mean)
            step.weight = (step.weight * k.reshape(-1, 1, 1, 1)).detach().float()
            step.bias = ((bias - m.running_mean) * k + (m.bias if m.affine else 0.0)).detach().float()
            self.folded += 1
            self.fold(node, args[0])
        elif kind == "relu":
            step = self.fusable(node, args[0])
            if step is None or step.relu or len(node.args) != 1 or set(node.kwargs) - {"inplace"}:
                raise Unsupported(f"{node.name}: a ReLU not right after a convolution or its residual add")
            step.relu = True
            self.fold(node, args[0])
        elif kind == "add":
            if len(args) != 2 or len(node.args) != 2 or node.kwargs:
                raise Unsupported(f"{node.name}: an add of other than two tensors")
            # the later convolution takes the sum: the other operand must exist when it runs
            a, b = sorted(args, key=lambda v: self.slot[v], reverse=True)
            step = self.fusable(node, a)
            if step is None or step.relu or step.other is not None or self.slot[b] == self.slot[a]:
                raise Unsupported(f"{node.name}: an add whose later operand is not a convolution's output")
            step.other = self.slot[b]
            self.fold(node, a)
        elif kind == "pool":
            self.add_step(node, self._pool(node, self.gm.get_submodule(node.target), self.slot[args[0]]))
        else:  # alias
            if self.gm.get_submodule(node.target).training:
                raise Unsupported(f"{node.name}: a Dropout in training mode")
            self.slot[node] = self.slot[args[0]]
        self.region.append(node)

    @staticmethod
    def _pool(node: fx.Node, m: nn.Module, src: int) -> Pool:
        if isinstance(m, nn.AdaptiveAvgPool2d):
            size = _pair(m.output_size)
            if None in size:
                raise Unsupported(f"{node.name}: AdaptiveAvgPool2d to {m.output_size} (sizes only)")
            return Pool(src, True, None, None, (0, 0), size=size)
        if m.return_indices or _pair(m.dilation) != (1, 1):
            raise Unsupported(f"{node.name}: MaxPool2d with indices or dilation")
        return Pool(src, False, _pair(m.kernel_size), _pair(m.stride or m.kernel_size), _pair(m.padding),
                    bool(m.ceil_mode))


def program(model: nn.Module, winograd: int = 1, dtype: str = "float32",
            ) -> tuple[Program, fx.GraphModule, fx.Node, _Walk]:
    """``model``'s conv region: (its program, the traced graph, the node whose value the program
    returns, the walk that made it: its region's nodes, BatchNorms folded). Raises Unsupported,
    naming the node, where it cannot be held."""
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:  # control flow on tensors, an untraceable module: another candidate serves it
        raise Unsupported(f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}") from e
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        raise Unsupported("the model takes no input")
    x = placeholders[0]
    walk = _Walk(gm, x, dtype)
    with torch.no_grad():  # BatchNorm folding computes new weights from the model's
        for node in gm.graph.nodes:
            if node.op == "placeholder" or not any(a in walk.slot for a in node.all_input_nodes):
                continue
            kind = _kind(node, gm)
            if kind is not None and all(a in walk.slot for a in node.all_input_nodes):
                walk.take(node, kind)
    prog = walk.prog
    if not any(isinstance(s, Conv) for s in prog.steps):
        raise Unsupported("no convolution reads the model's first input")
    inside = set(walk.region) | {x}
    out = {a for n in gm.graph.nodes if n not in inside for a in n.all_input_nodes if a in walk.slot}
    if len(out) != 1:
        names = ", ".join(sorted(n.name for n in out))
        raise Unsupported(f"the conv region hands {len(out)} values to the rest of the model ({names}); one only")
    (last,) = out
    if last is x:
        raise Unsupported("the model reads its input outside the conv region")
    last = _head(gm, walk, last)
    prog.out, prog.winograd = walk.slot[last], winograd
    return prog, gm, last, walk


def _flattens(node: fx.Node, gm: fx.GraphModule, value: fx.Node) -> bool:
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return type(m) is nn.Flatten and (m.start_dim, m.end_dim) == (1, -1)
    if node.op in ("call_function", "call_method") and node.target in (torch.flatten, "flatten"):
        return not node.kwargs and tuple(node.args) in ((value, 1), (value, 1, -1))
    return False


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
    m = _is(lin, gm, nn.Linear)
    if m is None or len(lin.args) != 1 or lin.kwargs:
        return last
    bias = None if m.bias is None else m.bias.detach().float()
    walk.add_step(lin, Linear(s, m.weight.detach().float(), bias))
    walk.prog.flat = True
    walk.region += [flat, lin]
    return lin


def rewrite(model: nn.Module, winograd: int = 1, dtype: str = "float32") -> tuple[fx.GraphModule, _Walk]:
    """``model`` traced, its conv region replaced by one Runner call (the model itself is not
    changed); and the walk that found the region."""
    prog, gm, last, walk = program(model, winograd, dtype)
    gm.add_submodule("conv_net", Runner(prog))
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module("conv_net", (next(n for n in gm.graph.nodes if n.op == "placeholder"),))
    last.replace_all_uses_with(call)
    for node in reversed(walk.region):
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
    runs as the model has it, on bf16 copies in bf16). ``winograd``: None follows WINOGRAD; False direct kernels only; True each 3x3
    convolution's fastest form; 4 or 2 that Winograd form wherever it applies (tests). ``notes``: a
    list the first built shape's account is written into (the report's "applied")."""

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
        wino = int(WINOGRAD if winograd is None else winograd)
        self.rewritten, walk = rewrite(model, wino, str(dtype).removeprefix("torch."))
        self.dtype = dtype
        if dtype == torch.bfloat16:
            self.rewritten = _head_in_bf16(self.rewritten)
        self.convs = sum(isinstance(s, Conv) for s in self.rewritten.conv_net.prog.steps)
        self.folded, self.notes = walk.folded, notes

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        if self.dtype == torch.float32:
            return out
        # answered in the inputs' floating dtype, as the other cast candidates do (stock.py)
        want = next((t.dtype for t in inputs.flatten((args, kwargs)) if t.is_floating_point()), torch.float32)
        return inputs.tree_map(lambda t: t.to(want) if t.is_floating_point() else t, out)

    def _trace(self, args, kwargs):
        fn = _Bound(self.rewritten, args, kwargs)
        with torch.no_grad():
            fn(*tensor_leaves(args, kwargs))  # builds this shape's program
        if self.notes is not None and not self.notes:
            self.notes.append(self.describe())
        return fn

    def describe(self) -> str:
        wino, dtype = self.winograd(), self.rewritten.conv_net.prog.dtype
        return (f"onednn_conv_net ({dtype}: {self.convs} convolutions, {self.folded} BatchNorms folded; of {len(wino)} 3x3 "
                f"stride-1, timed fastest: {wino.count(4)} Winograd F(4x4, 3x3), {wino.count(2)} F(2x2, 3x3), "
                f"{wino.count(0)} direct)")

    def winograd(self) -> list[int]:
        """Each built shape's form per eligible convolution (onednn_net.Net.winograd: 4, 2 or 0)."""
        return [c for net in self.rewritten.conv_net.nets.values() for c in net.winograd()]


__all__ = ["OneDNNConvNet", "Unsupported", "program", "rewrite", "why_not"]
