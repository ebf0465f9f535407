"""The recipe for serving a quantized model (what tk.optimize plans after tk.quantize).

The model stays at the precision it was quantized in: no dtype cast, no layout or
folding passes (a pt2e graph is already functional). What remains is compilation:
on CPU inductor with freezing, which is what lowers pt2e's quantize/dequantize pairs
around linears and convs into oneDNN int8 kernels with prepacked weights; on CUDA
inductor without freezing (torchao's tensor subclasses carry their own kernels).
"""

from __future__ import annotations

import math

import torch

from ..passes import registry
from ..passes.onednn_linear import graph_attr, graph_float_linears
from ..plan.cpu import gemm_choice
from ..recipe import Recipe
from . import onednn_int8
from .api import QuantInfo


def plan(qi: QuantInfo, device: str, level: str, bf16_native: bool = False, has_conv: bool = False,
         linears: dict | None = None, avg_pool: bool = False) -> Recipe:
    """``linears``: the graph's linear shapes, float and int8 (``linear_shapes``); ``avg_pool``: the
    graph holds an avg_pool2d (``passes.global_avg_pool.has_avg_pool``)."""
    rep = qi.report
    worst = rep.min_sqnr if rep.outputs and math.isfinite(rep.min_sqnr) else None
    quant = registry.make("quantize", scheme=qi.config.scheme, backend=qi.backend, kept=tuple(rep.kept),
                          min_sqnr_db=round(worst, 2) if worst is not None else None)
    cpu = torch.device(device).type == "cpu"
    notes = [f"quantized model ({qi.config.scheme} via {qi.backend}): served at the precision it was quantized in",
             "inductor freezing lowers q/dq pairs to oneDNN int8 kernels" if cpu else
             "inductor without freezing: torchao's tensor subclasses bring their kernels"]
    options = (("freezing", True),) if cpu else ()
    gemm = None
    if cpu and qi.backend == "pt2e" and level != "O0" and not has_conv:
        # (a conv graph's FLOPs are its convs': a kept head is a small share, and the C++ wrapper is
        # worth 1.08x on resnet50 int8)
        gemm = _float_gemm(linears or {}, notes)
    if gemm is not None:
        notes.append("inductor's Python wrapper: the C++ one cannot call oneDNN-prepacked linears")
    elif cpu and qi.backend == "pt2e":
        # inductor's C++ wrapper calls the int8 kernels without Python between them: the same int8-static
        # graph, bs1, one process, interleaved: resnet50 38.7 -> 35.8 ms (1.08x), bert-base 126.7 -> 122.0
        # (1.04x), outputs identical (benchmarks/diag_quant_wrapper.py; RESULTS.md). Compiling takes
        # ~20 s longer on 2 cores. The stock candidate (same graph, no wrapper) still competes.
        options += (("cpp_wrapper", True),)
        notes.append("inductor's C++ wrapper between the int8 kernels")
    static = cpu and qi.backend == "pt2e" and has_conv
    if static:
        # A second batch size recompiles with symbolic sizes, and inductor's int8 conv then asserts
        # contiguous strides on its channels-last output (torch 2.13, the digits CNN at batch 64 then 397:
        # "expected size 16==16, stride 1==64"); with sizes fixed per shape it runs. Linears only
        # (bert int8 at four (batch, seq) shapes) compile symbolically without error.
        notes.append("int8 convs: one compiled graph per input shape (inductor's symbolic-shape int8 conv asserts)")
    # int8 convs: torch's eager oneDNN quantized modules in a frozen trace, timed against the compiled
    # graph (onednn_int8.py says why: resnet50 bs1 1.15-1.25x on a 2-core Zen 4)
    int8_ops = static and onednn_int8.available()
    if int8_ops:
        notes.append("int8 convs: torch's oneDNN quantized modules (TorchScript) timed as a candidate")
    attention = "sdpa"
    if cpu and qi.backend == "pt2e" and bf16_native:
        # The int8 graph's attention runs in float32 (the quantizer leaves it), torch's flash kernel:
        # 7.0 of bert-base int8 bs1's 45 ms on a 2-core Zen 4. Its GEMMs in bf16 run at twice
        # fp32's rate there (math form: 360 us per layer against SDPA's 482); bf16's rounding of
        # the scores (~0.4%) is below the int8 activations' own error, and the guard checks the
        # result against the quantized reference. Chosen per shape by measurement.
        attention = "auto-bf16"
        notes.append("attention: the math form in bf16 where measured faster (native bf16 CPU)")
    passes = (quant, gemm) if gemm is not None else (quant,)
    if cpu and qi.backend == "pt2e" and gemm is None and not has_conv and level != "O0" and INT8_LINEAR:
        from ..kernels import cpu_qlinear

        why = cpu_qlinear.load()
        if why is None:
            # the int8 linears as torchkiln::qlinear_u8, which keeps its oneDNN primitive (passes/int8_linear.py).
            # Not for conv graphs: their linears are a head (a small share), and their faster candidates
            # (int8 modules, int8 net) do not compile the graph
            passes += (registry.make("int8_linear"),)
            notes.append("int8 linears: oneDNN primitives built once (torchkiln::qlinear_u8)")
        else:
            notes.append(f"int8 linears: inductor's (torchkiln::qlinear_u8 unavailable: {why})")
    if avg_pool and level != "O0":  # EfficientNet-B0 int8 compiled bs1: 237 -> 4.3 ms (RESULTS.md)
        passes += (registry.make("global_avg_pool"),)
    return Recipe(device=device, level=level, dtype="float32", dtype_mode="none", passes=passes,
                  attention=attention, compile=level != "O0", compile_options=options, static_shapes=static,
                  onednn_graph=int8_ops, notes=tuple(notes))


# Whether the plan takes passes/int8_linear.py where it can (benchmarks/diag_int8_linear.py flips it
# to build the other variant in the same process).
INT8_LINEAR = True


def has_conv(model) -> bool:
    """Whether a pt2e-quantized model's graph holds a convolution."""
    graph = getattr(getattr(model, "graph", None), "graph", None)
    # by op packet, not by name: "conv" is also in e.g. convert_element_type
    convs = {getattr(torch.ops.aten, n, None) for n in ("conv1d", "conv2d", "conv3d", "convolution")} - {None}
    return graph is not None and any(n.op == "call_function" and getattr(n.target, "overloadpacket", None) in convs
                                     for n in graph.nodes)


def linear_shapes(model) -> dict[str, list[tuple[int, int]]]:
    """(in, out) features of a pt2e-quantized graph's linears: "float" (kept in float32, see
    passes/onednn_linear.graph_float_linears) and "int8" (weight through a dequantize node)."""
    gm = getattr(model, "graph", None)
    out: dict[str, list[tuple[int, int]]] = {"float": [], "int8": []}
    if not isinstance(gm, torch.fx.GraphModule):
        return out
    kept = set(graph_float_linears(gm))
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.linear.default:
            continue
        w = n.args[1]
        if n not in kept and getattr(w, "op", None) == "call_function" and w.args:
            w = w.args[0]  # dequantize(int8 weight, ...)
        t = graph_attr(gm, w)
        if t is not None:
            out["float" if n in kept else "int8"].append((t.shape[1], t.shape[0]))
    return out


# What inductor's C++ wrapper is worth on a pt2e int8 linear graph: bert-base int8 bs1 1.04x
# (diag_quant_wrapper.py, RESULTS.md). The wrapper cannot call oneDNN-prepacked linears, so routing
# the float32 linears there must be expected to gain more than this.
WRAPPER_GAIN = 0.05


def _float_gemm(linears: dict, notes: list):
    """The onednn_linear pass for a pt2e int8 graph's float32 linears (the layers kept in float),
    where the GEMM measurement here expects it to gain more than the C++ wrapper it rules out.
    Expected gain: the float linears' share of the linear FLOPs (rows taken as equal) times
    1 - aten / oneDNN GFLOP/s. Real all-MiniLM-L6-v2 int8-dynamic bs16 with 8 of 27 layers kept
    (share 0.36), 2-core Zen 5: measured aten 173 vs oneDNN 481 GFLOP/s, so 0.23 expected; the
    served model went from 57.7 to 39.7 ms (RESULTS.md, twenty-sixth session)."""
    fl, q8 = linears.get("float", []), linears.get("int8", [])
    if not fl:
        return None
    shape = max(set(fl), key=lambda s: fl.count(s) * s[0] * s[1])
    choice, rates = gemm_choice(torch.float32, 128, *shape)
    if not rates:
        return None
    share = sum(k * n for k, n in fl) / sum(k * n for k, n in fl + q8)
    gain = share * (1 - rates["aten"] / rates["onednn"])
    use = choice == "onednn" and gain > WRAPPER_GAIN
    notes.append(f"{len(fl)} float32 linear(s) in the int8 graph ({share:.0%} of linear FLOPs): GEMM 128x{shape[0]}x"
                 f"{shape[1]} aten {rates['aten']} vs oneDNN {rates['onednn']} GFLOP/s, expected gain {gain:.0%} -> "
                 + ("oneDNN" if use else "aten (oneDNN not 10% faster)" if choice != "onednn"
                    else f"inductor's, with the C++ wrapper (the gain is not above its {WRAPPER_GAIN:.0%})"))
    if not use:
        return None
    return registry.make("onednn_linear", shape=(128, *shape), aten_gflops=rates["aten"], onednn_gflops=rates["onednn"])


def tolerances(qi: QuantInfo, n: int) -> list[float]:
    """The guard's tolerance when the reference is the eager quantized model. Compiled int8
    kernels round differently from the eager quantize/dequantize reference (requantization,
    fused scales): each is about one quantization error e away from fp32, so they may be 2e
    apart. Allowed: 4e (e: relative L2 error of that output against fp32, from the accuracy
    report), at least 1e-3. A small CNN, int8-static: e = 0.0057, compiled vs eager 0.018, 100%
    argmax agreement; a candidate that lost more precision than that fails."""
    errs = {o.index: 10 ** (-o.sqnr_db / 20) for o in qi.report.outputs if math.isfinite(o.sqnr_db)}
    default = max(errs.values(), default=0.05)
    return [max(1e-3, 4 * errs.get(i, default)) for i in range(n)]
