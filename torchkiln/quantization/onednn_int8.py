"""Serving a pt2e int8 CNN on the CPU through torch's eager oneDNN quantized ops, in a frozen
TorchScript trace: one more candidate beside the compiled graph, served only where it is faster
and passes the guard.

Why: inductor lowers an int8 graph's convolutions to ``onednn::qconv2d_pointwise``, which builds
a oneDNN primitive descriptor and allocates its scratchpad on every call; torch's eager quantized
conv modules (``quantized::conv2d*``, onednn engine) keep the primitive per layer. The VNNI
kernels are the same either way (ONEDNN_VERBOSE: 4.7 ms of resnet50 bs1's convolutions per call
on a 2-core Zen 4, 4.6 ms in IPEX 2.8); around them the compiled graph spent ~1.5 ms more. The
same quantized resnet50, one process, interleaved: compiled 6.97 ms, torch's FX-converted modules
in a frozen trace 5.69 ms (1.23x; RESULTS.md, "resnet50 int8 through torch's eager oneDNN ops").
Nothing is hand-written below the graph: the kernels and modules are torch's (torch.ao).

What it does: rewrites the converted pt2e graph (quantize/dequantize ops around aten convs) into
torch.ao's quantized modules, keeping the calibrated scales, so the numbers are those of the
quantization the accuracy report measured:

    dq(x) -> conv(dq_per_channel(w)) [-> relu] -> q       quantized Conv2d / ConvReLU2d
    dq(x) -> conv -> hardtanh(0, 6) -> q                 ConvReLU2d, where q's range ends at or below 6
    dq(x) -> conv -> add(dq(y)) [-> relu] -> q            ConvAdd2d / ConvAddReLU2d
    dq(x) -> max_pool2d | adaptive_avg_pool2d | flatten -> q (same scale): the op on the int8 tensor

Everything else runs as the pt2e graph has it, in float32 on dequantized tensors (weights of the
float layers dequantized once, here).

Process-wide state: torch picks quantized kernels by ``torch.backends.quantized.engine``; the
conv + add kernels exist only for 'onednn', and weights are packed for the engine current when
packing. So packing and every call run with the engine set to 'onednn' and put back after
(reference-counted across threads), as onednn_graph.py scopes TorchScript's fuser switch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings

import torch
from torch import fx, nn

from ..passes.onednn_graph import MAX_SIGNATURES, PerSignature, Unsupported, frozen_trace

aten = torch.ops.aten
_ENGINE_LOCK = threading.Lock()
_engine_state = {"users": 0, "before": None}


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and "onednn" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops, "quantized_decomposed"))


@contextlib.contextmanager
def onednn_engine():
    """torch's quantized engine set to 'onednn' while any caller is inside; the engine found
    before the first one is put back when the last leaves."""
    with _ENGINE_LOCK:
        if _engine_state["users"] == 0:
            _engine_state["before"] = torch.backends.quantized.engine
            if _engine_state["before"] != "onednn":
                torch.backends.quantized.engine = "onednn"
        _engine_state["users"] += 1
    try:
        yield
    finally:
        with _ENGINE_LOCK:
            _engine_state["users"] -= 1
            if _engine_state["users"] == 0 and _engine_state["before"] != "onednn":
                torch.backends.quantized.engine = _engine_state["before"]


@functools.cache
def _ops():
    qd = torch.ops.quantized_decomposed
    return (qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default)


RELU = (aten.relu.default, aten.relu_.default)
HARDTANH = (aten.hardtanh.default, aten.hardtanh_.default)  # ReLU6 (MobileNets)
ADD = (aten.add.Tensor, aten.add_.Tensor)
# ops that run on a quantized tensor and keep its scale (pt2e shares their input's qparams)
SAME_SCALE = (aten.max_pool2d.default, aten.adaptive_avg_pool2d.default, aten.flatten.using_ints)


class _Lowering:
    """One pass over the pt2e graph, emitting the new graph; ``env`` maps each old node to
    ("f", node): a float (or any plain) value; ("q", node, scale, zp): a quint8 tensor (the old
    node was a uint8 quantize); ("dq", entry): the dequantize of a ("q", ...) entry; ("w", old):
    a constant weight's dequantize, folded to a float constant only if a float op reads it."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm  # read only: its constants are shared, never changed
        self.graph = fx.Graph()
        self.graph._codegen = gm.graph._codegen  # the same pytree in/out handling as the pt2e graph
        self.attrs: dict[str, object] = {}
        self.env: dict[fx.Node, tuple] = {}
        self.done: set[fx.Node] = set()
        self.floats: dict[fx.Node, fx.Node] = {}
        self.lowered = 0

    def const(self, node) -> torch.Tensor | None:
        if isinstance(node, fx.Node) and node.op == "get_attr":
            return functools.reduce(getattr, node.target.split("."), self.gm)
        return None

    def attr(self, value, stem: str) -> fx.Node:
        name = f"{stem}_{len(self.attrs)}"
        self.attrs[name] = value
        return self.graph.get_attr(name)

    # values
    def float_of(self, e) -> fx.Node:
        if e[0] == "f":
            return e[1]
        if e[0] == "q":  # the old graph used the raw uint8 codes
            return self.graph.call_method("int_repr", (e[1],))
        if e[0] == "w":
            if e[1] not in self.floats:
                vals = [self.const(a) if isinstance(a, fx.Node) else a for a in e[1].args]
                self.floats[e[1]] = self.attr(e[1].target(*vals), "w")
            return self.floats[e[1]]
        q = e[1][1]
        if q not in self.floats:
            self.floats[q] = self.graph.call_method("dequantize", (q,))
        return self.floats[q]

    def arg(self, a):
        return fx.node.map_arg(a, lambda n: self.float_of(self.env[n]))

    def qparams(self, node) -> tuple[float, int] | None:
        """(scale, zero point) of a uint8 quantize/dequantize node with literal parameters."""
        q, dq, _ = _ops()
        if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in (q, dq)
                and len(node.args) >= 6):
            return None
        _, scale, zp, lo, hi, dtype = node.args[:6]
        if isinstance(scale, float) and isinstance(zp, int) and (lo, hi, dtype) == (0, 255, torch.uint8):
            return scale, zp
        return None

    def quantized_input(self, node) -> tuple | None:
        """The ("q", ...) entry a dequantize node reads, if it is one (entered now if the walk
        has not reached that dequantize yet)."""
        if not isinstance(node, fx.Node):
            return None
        if node not in self.env:
            self.dequantize(node)
        e = self.env.get(node)
        return e[1] if e is not None and e[0] == "dq" else None

    def dequantize(self, node: fx.Node) -> bool:
        """A uint8 dequantize of a quantize already lowered, with its parameters: no op, its entry."""
        src = node.args[0] if node.target is _ops()[1] and node.args else None
        e = self.env.get(src) if isinstance(src, fx.Node) else None
        if e is None or e[0] != "q" or self.qparams(node) is None or self.qparams(node) != e[2:]:
            return False
        self.env[node] = ("dq", e)
        return True

    @staticmethod
    def only_user(node: fx.Node) -> fx.Node | None:
        return next(iter(node.users)) if len(node.users) == 1 else None

    # the walk
    def run(self) -> fx.GraphModule:
        q_op = _ops()[0]
        plans = self.chains()
        deferred = {n for p in plans.values() for n in p[-1]}
        for node in self.gm.graph.nodes:
            if node in self.done or node in deferred:
                continue
            if node in plans:
                if self.conv(node, plans[node]):
                    continue
                for n in plans[node][-1]:  # not quantized after all: the float ops, in their order
                    self.copy(n)
            if node.op == "placeholder":
                self.env[node] = ("f", self.graph.placeholder(node.target, type_expr=node.type))
            elif node.op == "get_attr":
                self.env[node] = ("f", self.attr(self.const(node), "c"))
            elif node.op == "output":
                self.graph.output(self.arg(node.args[0]), type_expr=node.type)
            elif node.target is q_op and self.qparams(node) and self.env[node.args[0]][0] == "f":
                s, zp = self.qparams(node)
                out = self.graph.call_function(torch.quantize_per_tensor, (self.float_of(self.env[node.args[0]]),
                                                                          s, zp, torch.quint8))
                self.env[node] = ("q", out, s, zp)
            elif not (self.dequantize(node) or self.same_scale(node) or self.linear(node)):
                self.copy(node)
        if not self.lowered:
            raise Unsupported("no int8 convolution in this graph matched the quantized-module patterns")
        out = fx.GraphModule(self.attrs, self.graph)
        out.graph.eliminate_dead_code()  # the lowered convs' float producers, the weights' dequantizes
        _copy_shared_accumulators(out)
        used = {n.target for n in out.graph.nodes if n.op in ("get_attr", "call_module")}
        for name in set(self.attrs) - used:
            delattr(out, name)
        out.recompile()
        return out

    def copy(self, node: fx.Node) -> None:
        _, _, dqc = _ops()
        if node.target is dqc and all(self.const(a) is not None or not isinstance(a, fx.Node) for a in node.args):
            self.env[node] = ("w", node)
            return
        if node.op == "call_module":  # e.g. export's input guards
            self.attrs[node.target] = self.gm.get_submodule(node.target)
        out = self.graph.create_node(node.op, node.target, self.arg(node.args), self.arg(node.kwargs), node.name)
        self.env[node] = ("f", out)

    def chain_end(self, node: fx.Node) -> fx.Node | None:
        """The uint8 quantize that is ``node``'s only user, if it is."""
        q_op = _ops()[0]
        u = self.only_user(node)
        return u if u is not None and u.target is q_op and self.qparams(u) else None

    def same_scale(self, node: fx.Node) -> bool:
        if node.op != "call_function" or node.target not in SAME_SCALE or not node.args:
            return False
        src = self.quantized_input(node.args[0])
        end = self.chain_end(node)
        if src is None or end is None or self.qparams(end) != src[2:]:
            return False
        rest = self.arg(node.args[1:])
        out = self.graph.call_function(node.target, (src[1], *rest), self.arg(node.kwargs))
        self.env[end] = ("q", out, *src[2:])
        self.done.update((node, end))
        return True

    def chains(self) -> dict[fx.Node, tuple]:
        """Each int8 conv pattern by its last node (the output quantize): (the conv's arguments with
        defaults filled, its weight as a quantized tensor, the add's other operand or None, relu?, the
        nodes between). Found by structure; whether its inputs are
        quantized tensors is known only when the walk reaches the end, where it is emitted (a
        residual add's other branch may come later in the graph than the conv)."""
        out = {}
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or node.target is not aten.conv2d.default or node.kwargs:
                continue
            a = list(node.args) + [None, [1, 1], [0, 0], [1, 1], 1][len(node.args) - 2:]
            weight = self.weight(a[1])
            if weight is None or not isinstance(a[4], (list, tuple)):
                continue
            if a[2] is not None and self.const(a[2]) is None:
                continue
            chain, other, relu = [node], None, False
            u = self.only_user(node)
            if u is not None and u.op == "call_function" and u.target in ADD and not u.kwargs and len(u.args) == 2:
                other = u.args[1] if u.args[0] is node else u.args[0]
                if other is node or not isinstance(other, fx.Node):
                    continue
                chain.append(u)
                u = self.only_user(u)
            clamp = None
            if u is not None and u.op == "call_function" and u.target in RELU:
                relu = True
                chain.append(u)
            elif u is not None and u.op == "call_function" and u.target in HARDTANH and not u.kwargs:
                clamp = (list(u.args) + [-1.0, 1.0])[1:3]
                chain.append(u)
            end = self.chain_end(chain[-1])
            if end is None or any(len(n.users) != 1 for n in chain):
                continue
            if clamp is not None:
                # hardtanh(0, hi) before a uint8 quantize with zero point 0 and hi at or past the top
                # code: the requantized output's own saturation clamps the same values (ReLU6 calibrated
                # at <= 6); any other clamp stays in float
                scale, zp = self.qparams(end)
                if not (clamp[0] == 0 and zp == 0 and clamp[1] / scale >= 254.5):
                    continue
                relu = True
            out[end] = (a[:7], weight, other, relu, chain)
        return out

    def conv(self, end: fx.Node, plan: tuple) -> bool:
        """Emit the quantized conv module for ``plan`` at ``end``, if its inputs are quantized."""
        import torch.ao.nn.intrinsic.quantized as nniq
        import torch.ao.nn.quantized as nnq

        (x, _, bias, stride, padding, dilation, groups), weight, other, relu, _ = plan
        src = self.quantized_input(x)
        extra = self.quantized_input(other) if other is not None else None
        if src is None or (other is not None and extra is None):
            return False
        cls = {(False, False): nnq.Conv2d, (True, False): nniq.ConvReLU2d,
               (False, True): nniq.ConvAdd2d, (True, True): nniq.ConvAddReLU2d}[(relu, other is not None)]
        s, zp = self.qparams(end)
        out_ch, in_per_group = weight.shape[:2]
        m = cls(in_per_group * groups, out_ch, tuple(weight.shape[2:]), tuple(stride), tuple(padding), tuple(dilation),
                groups, bias=bias is not None)
        m.set_weight_bias(weight, None if bias is None else self.const(bias).detach().float())
        m.scale, m.zero_point = s, zp
        name = f"qconv_{self.lowered}"
        self.attrs[name] = m
        self.lowered += 1
        ins = (src[1],) if other is None else (src[1], extra[1])
        self.env[end] = ("q", self.graph.call_module(name, ins), s, zp)
        return True

    def linear(self, node: fx.Node) -> bool:
        """A linear on a quantized input with an int8 weight whose output stays float: DynamicLinear."""
        if node.op != "call_function" or node.target is not aten.linear.default or node.kwargs:
            return False
        x, w, bias = (list(node.args) + [None])[:3]
        if any(u.target is _ops()[0] for u in node.users):  # a quantized output: not this pattern
            return False
        src = self.quantized_input(x)
        weight = self.weight(w)
        if src is None or weight is None or (bias is not None and self.const(bias) is None):
            return False
        name = f"qlinear_{len(self.attrs)}"
        self.attrs[name] = DynamicLinear(weight, None if bias is None else self.const(bias).detach().float())
        self.env[node] = ("f", self.graph.call_module(name, (self.float_of(self.env[x]),)))
        return True

    def weight(self, node) -> torch.Tensor | None:
        """A per-channel symmetric int8 weight (a constant dequantize_per_channel over axis 0) as a
        quantized tensor, the form torch's quantized conv modules pack."""
        dqc = _ops()[2]
        if not (isinstance(node, fx.Node) and node.target is dqc and len(node.args) >= 7):
            return None
        codes, scales, zps = (self.const(a) for a in node.args[:3])
        axis, lo, hi, dtype = node.args[3:7]
        if any(t is None for t in (codes, scales, zps)) or (axis, lo, hi, dtype) != (0, -128, 127, torch.int8):
            return None
        if bool(zps.any()):  # oneDNN's int8 weights are symmetric
            return None
        return torch._make_per_channel_quantized_tensor(codes, scales.double(), zps.long(), 0)


class DynamicLinear(nn.Module):
    """A linear whose output the pt2e graph leaves in float (a classifier head): int8 weights, the
    input re-quantized per call over its own range (``quantized::linear_dynamic``). Its input is
    already on the calibrated uint8 grid, so its own range is no wider and the step no coarser.
    Why: in float it read resnet50's 8 MB fc weight on every call, 0.35 ms of 5.8 (torch.profiler)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        from torch.ao.nn.quantized.modules.linear import LinearPackedParams

        self.params = LinearPackedParams(dtype=torch.qint8)
        self.params.set_weight_bias(weight, bias)

    def forward(self, x):
        return torch.ops.quantized.linear_dynamic(x, self.params._packed_params, False)


def _copy_shared_accumulators(gm: fx.GraphModule) -> None:
    """torch's ConvAdd2d / ConvAddReLU2d write their output into the add's operand (oneDNN's sum
    post-op accumulates in place), so an operand that is also the conv's input, or is read again
    later, gets a copy first. Without it ``relu(conv(x) + x)`` with x read again after was 24% off
    the pt2e graph (forty-fifth session's finding; tests/quantization/test_onednn_int8.py)."""
    import torch.ao.nn.intrinsic.quantized as nniq

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target),
                                                      (nniq.ConvAdd2d, nniq.ConvAddReLU2d)):
            continue
        src, acc = node.args[:2]
        if acc is src or any(order.get(u, -1) > order[node] for u in acc.users):
            with gm.graph.inserting_before(node):
                node.args = (src, gm.graph.call_method("clone", (acc,)), *node.args[2:])


def lower(gm: fx.GraphModule) -> fx.GraphModule:
    """The pt2e int8 graph ``gm`` rewritten onto torch's quantized modules (weights packed for
    oneDNN). Raises Unsupported when no convolution matched."""
    if not available():
        raise Unsupported("this torch build has no oneDNN quantized engine")
    with onednn_engine(), warnings.catch_warnings():
        # torch 2.13 deprecates quantized tensors (it warns once, at the first one made); the path is
        # a timed candidate, so where a later torch removes them it fails and the compiled graph serves
        warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
        return _Lowering(gm).run()


class OneDNNInt8(PerSignature):
    """Calls a tk.quantize'd (pt2e) CNN through the lowered graph, one frozen TorchScript trace
    per input signature (up to MAX_SIGNATURES; past that the quantized model runs as it is)."""

    def __init__(self, qmodel: nn.Module, max_signatures: int = MAX_SIGNATURES):
        gm = getattr(qmodel, "graph", None)
        if not isinstance(gm, fx.GraphModule):
            raise Unsupported(f"{type(qmodel).__name__} is not a pt2e-quantized model (tk.quantize's graph)")
        super().__init__(qmodel, max_signatures)
        self.lowered = lower(gm)

    def _scope(self):
        return onednn_engine()

    def _trace(self, args, kwargs) -> torch.jit.ScriptModule:
        with onednn_engine(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")  # see lower()
            # an exported graph: torch.export refused data-dependent branches; its input guards read shapes
            return frozen_trace(self.lowered, args, kwargs, branches_checked=True)


__all__ = ["OneDNNInt8", "Unsupported", "available", "lower", "onednn_engine"]
