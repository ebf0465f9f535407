"""Weight-only quantization of the fast decoder's Linears, with quantization/weight_only.py's
modules (which kernel serves which call is said there). int8: one scale per output channel;
int4: asymmetric groups along the input."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from ..kernels import cpu_gemv, cuda_int4
from ..quantization import gemv, gptq
from ..quantization.weight_only import Int4Linear, Int8Linear, cpu_kernels
from .model import describe, kernel_why, pick, time_forms

# int4 kernel. "auto" (or "cuda"): on CUDA in bf16, torchkiln's own CUDA kernel (kernels/cuda_int4.cu,
# tensor cores, Int4Linear's mma layout) where nvcc builds it (once per machine and group size): on the H200 at
# Llama-3-8B's shapes 1.2-1.9x tinygemm per shape, and int4 decode 437 tok/s against tinygemm's 327
# (benchmarks/RESULTS.md, forty-first session). Elsewhere, or where it cannot be built (the report says
# why), tinygemm (torch's own int4 kernel, aten._weight_int4pack_mm) called on plain buffers: 1.44-1.81x
# bf16, the Triton int4 GEMV 1.10-1.44x (RESULTS.md, "Triton int8/int4 decode GEMVs"); off CUDA,
# Int4Linear's own layout (the expression; it alone decoded at 66 tok/s on the H200). "torchao"
# reaches tinygemm through torchao's tensor subclass: its decode step left the GPU idle ~2 ms per
# token (RESULTS.md, "int4 decode"), so it is kept only for comparison. "tinygemm" and "triton"
# force one.
INT4_IMPL = "auto"
INT4_GROUPS = (128, 64, 32)  # the first that divides a layer's input width
# quant="int4": the output head in int4 too, where torchkiln's CUDA kernel serves it (as gpt-fast's int4
# and torchao's quantize_ over every Linear do); elsewhere the head goes int8. It is the largest single
# matrix: Llama-3-8B's (128256 x 4096) read 131 us a token in int8 on the H200, a 15th of the int4 step
# (RESULTS.md, forty-third session). False: an int8 head in both modes (logits closer to the float ones).
INT4_HEAD = True


def _int4_group(lin: nn.Linear) -> int | None:
    return next((g for g in INT4_GROUPS if lin.in_features % g == 0), None)


def _takes_mma(lin: nn.Linear, group: int | None, impl: str) -> bool:
    """Does torchkiln's CUDA int4 kernel serve ``lin`` under INT4_IMPL ``impl``?"""
    return group is not None and impl in ("auto", "cuda") and Int4Linear.fits_mma(lin, group)


def gptq_codes(model: nn.Module, decoder: nn.Module, quant: str, data, device: torch.device,
               short: list | None = None) -> dict[int, tuple]:
    """id(projection) -> its GPTQ codes (quantization/gptq.py) for every layer projection of ``decoder``,
    with the second moments of its inputs collected by running the model's own forward over ``data``
    (``short``: gptq.codes_for's, the projections rounded to nearest for want of calibration tokens)."""
    names = {id(m): n for n, m in model.named_modules()}
    jobs = {names[id(src)]: getattr(layer, attr) for layer in decoder.layers for attr, src in layer.sources.items()}
    groups = {n: _int4_group(lin) for n, lin in jobs.items()}
    if quant == "int4":  # a width no group divides stays float (_replace skips it too)
        jobs = {n: lin for n, lin in jobs.items() if groups[n] is not None}
    groups = {n: g or INT4_GROUPS[-1] for n, g in groups.items()}  # int8 ignores the group
    scheme = "int4-weight-only" if quant == "int4" else "int8-weight-only"
    codes = gptq.codes_for(model, list(jobs), scheme, groups, data, device, show=False,
                           weights={n: lin.weight for n, lin in jobs.items()}, short=short)
    return {id(jobs[n]): c for n, c in codes.items()}


def quantize(decoder: nn.Module, quant: str, device: torch.device, codes: dict[int, tuple] | None = None) -> int:
    """Replace the decoder's layer Linears (and, where a kernel serves it, the output head: in int8,
    or in int4 for quant="int4" where torchkiln's CUDA kernel takes it, INT4_HEAD); returns how
    many. Without a kernel the head stays floating point: dequantized inside the expression, the
    compiler kept it an external GEMM whose weight copy cost 1.26 ms per token (21% of the int8
    step) on the H200 profile."""
    if quant == "int4" and INT4_IMPL == "torchao" and importlib.util.find_spec("torchao") and not codes:
        done = _torchao_int4(decoder.layers, device)
    else:
        done = _replace(decoder.layers, quant, INT4_IMPL, codes)
    head = decoder.head.weight
    group = _int4_group(decoder.head)
    if quant == "int4" and INT4_HEAD and _takes_mma(decoder.head, group, INT4_IMPL):
        decoder.head = Int4Linear(decoder.head, group, mma=True)
        done += 1
    elif gemv.wanted(head) or cpu_kernels(head):
        decoder.head = Int8Linear(decoder.head)
        done += 1
    if head.is_cuda:  # the Triton kernels' tuning, before any capture (whichever head)
        gemv.warm(decoder, decoder.norm.weight.dtype)
    return done


def _torchao_int4(layers: nn.Module, device: torch.device) -> int:
    from ..quantization.config import QuantConfig
    from ..quantization.schemes import torchao, torchao_config

    done = sum(isinstance(m, nn.Linear) for m in layers.modules())
    torchao().quantize_(layers, torchao_config(QuantConfig("int4-weight-only"), device),
                        filter_fn=lambda m, name: isinstance(m, nn.Linear))
    return done


def _replace(layers: nn.Module, quant: str, impl: str = "auto", codes: dict[int, tuple] | None = None) -> int:
    done = 0
    for m in list(layers.modules()):
        for name, child in list(m.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            mine = (codes or {}).get(id(child))  # GPTQ's, where calibration data was given
            if quant == "int8":
                setattr(m, name, Int8Linear(child, codes=mine))
            else:
                group = _int4_group(child)
                if group is None:
                    continue  # counted out: the report shows fewer quantized layers
                mma = _takes_mma(child, group, impl)
                tiny = not mma and impl in ("auto", "cuda", "tinygemm") and Int4Linear.fits_tinygemm(child, group)
                setattr(m, name, Int4Linear(child, group, tinygemm=tiny, codes=mine, mma=mma))
            done += 1
    return done


def head_kind(head: nn.Module) -> str:
    return "int8" if isinstance(head, Int8Linear) else "int4" if isinstance(head, Int4Linear) else "float"


MMA_KERNEL = "torchkiln CUDA (tensor cores)"  # int4_kernels' name for Int4Linear's mma layout


def _kernel_name(m: Int4Linear) -> str:
    return MMA_KERNEL if m.mma else "tinygemm" if m.tinygemm else \
        "Triton GEMV" if m.kernel else "dequantizing expression"


def int4_kernels(decoder: nn.Module) -> tuple[str | None, str | None]:
    """(the kernels serving the decoder's int4 layers, in words; where "auto" would have taken
    torchkiln's CUDA kernel for some of them and did not, which ones run what instead and why)."""
    layers = [m for m in decoder.modules() if isinstance(m, Int4Linear)]
    if not layers:
        return None, None
    what = ", ".join(sorted({_kernel_name(m) for m in layers}))
    rest = [m for m in layers if not m.mma]
    if INT4_IMPL not in ("auto", "cuda") or not layers[0].packed.is_cuda or not rest:
        return what, None
    dev, group = rest[0].packed.device, rest[0].group
    # a group the kernel takes: its library's build (tried by fits_mma, cached); else build nothing
    why = cuda_int4.load(dev, group) if group in cuda_int4.GROUPS else cuda_int4.unavailable(dev)
    if why is None:
        dtype = (rest[0].scale_zero if rest[0].tinygemm else rest[0].scale).dtype
        why = f"it takes bf16 only, not {dtype}" if dtype != torch.bfloat16 else \
            "their shapes do not fit it (it takes outputs a multiple of 16, inputs of 64, groups of 64-256)"
    others = ", ".join(sorted({_kernel_name(m) for m in rest}))
    return what, f"{len(rest)} of {len(layers)} int4 layers run {others}, not torchkiln's CUDA kernel: {why}"


def cpu_int8_rows(decoder: nn.Module) -> str | None:
    """The CPU's compiled int8 decode: one-row products through torchkiln's CPU GEMV, for every
    Int8Linear of ``decoder``, where it measures faster here than Int8Linear's own form (torch's
    ``_weight_int8pack_mm`` in bf16, the dequantizing expression in float32; both compiled, after
    the pre-MLP norm as in model.row_forms) on the layers' up projections. Returns the report's line (None: no int8 layer)."""
    ups = [layer.up for layer in decoder.layers if isinstance(layer.up, Int8Linear)]
    if not ups:
        return None
    x = torch.randn(1, 1, ups[0].in_features, dtype=ups[0].scales.dtype)
    own = ups[0].cpu_kernel
    norm = getattr(decoder.layers[0], "norm2", None) or nn.Identity()  # in front, as in the step (row_forms)
    forms = {"torch": lambda x, q, s: Int8Linear.product(norm(x), q, s, own)}
    why = kernel_why(x.dtype, ups[0].weight)
    if why is None:
        forms["kernel"] = lambda x, q, s: cpu_gemv.gemv(norm(x), q, s)
    times = time_forms(forms, [(x, m.weight, m.scales) for m in ups])
    form = pick(times, "torch")
    head = decoder.head
    if form == "kernel" and not isinstance(head, Int8Linear) and cpu_gemv.fits(x.dtype, head.weight):
        # quantize()'s rule (the head in int8 where a kernel serves it) now that one does: in
        # float32 the head was a quarter of llama-125m's int8 decode bytes at 4x the size
        decoder.head = Int8Linear(head)
    for m in decoder.modules():
        if isinstance(m, Int8Linear):
            m.row_kernel = form == "kernel"
    return "int8 " + describe(form, times, why) + ("; head int8" if decoder.head is not head else "")
