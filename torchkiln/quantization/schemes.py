"""Which flow runs each scheme on each device, and whether it is fast there.

Measured on the dev machine (AMD EPYC Zen 3, AVX2, no VNNI; benchmarks/RESULTS.md,
"Quantization"): torchao's per-token int8 dynamic linear runs through ``torch._int_mm``,
whose CPU kernel is a reference loop (130 ms for a 16x1024x4096 GEMM, fp32 5 ms), so on CPU
every activation-quantizing scheme goes through pt2e + X86InductorQuantizer, which inductor
lowers to oneDNN int8 kernels (a 1024-4096-1024 MLP: 3.2 ms int8 static vs 8.7 ms fp32). On
CUDA torchao's tensor subclasses call cuBLASLt int8/fp8 GEMMs (int8-dynamic, fp8); the weight-only
schemes take torchkiln's own layers (weight_only.py) wherever backend_for says so.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .._log import quiet_deprecations
from .config import SCHEMES, QuantConfig


@contextlib.contextmanager
def _quiet_torchao():
    # torchao logs a warning for each optional C extension that does not match the installed
    # torch (CUDA-only kernels on a CPU build); they are irrelevant to the schemes used here.
    # Importing it imports inductor, whose torch.utils.mkldnn import warns (_log.quiet_deprecations).
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with quiet_deprecations():
            yield
    finally:
        logger.setLevel(level)


def torchao():
    try:
        with _quiet_torchao():
            import torchao.quantization as q
    except ImportError as e:  # pragma: no cover - torchao is a dependency
        raise ImportError("tk.quantize needs torchao: pip install torchao (a version built for your torch "
                          f"{torch.__version__})") from e
    return q


def backend_for(config: QuantConfig, device: torch.device, dtype: torch.dtype | None = None,
                generates: bool = False) -> str:
    """The flow for a scheme on a device, for a model whose floating dtype is ``dtype``;
    ``generates``: a causal LM (its generate() must keep working)."""
    if config.backend != "auto":
        return config.backend
    if config.gptq:  # GPTQ's codes go into torchkiln's own weight-only layers
        return "kernels"
    if config.static:
        return "pt2e"
    if config.scheme == "int8-dynamic" and device.type == "cpu" and not generates:
        # not for a causal LM: pt2e exports its forward into a graph with no generate(), and export
        # raised on transformers' DynamicCache output (torch 2.13, transformers 5.23); torchao swaps
        # modules, so the model keeps its generate
        return "pt2e"
    if config.scheme.endswith("-weight-only") and device.type == "cuda":
        # weight_only.py's layers: torchao's int8 weight-only decoded Llama-3-8B at 136 tok/s on the
        # H200 against 250 for the Triton GEMV, and its int4 tensor subclass at 130-180 against 277
        # for the same tinygemm kernel on plain buffers (benchmarks/RESULTS.md, LLM decode)
        return "kernels"
    if config.scheme == "int4-weight-only" and device.type == "cpu":
        # float32 models too: torchao's int4 on the CPU ran MiniLM (float32, bs16) at 12.0 s a call, torchkiln's
        # Int4Linear at 0.23 s against fp32's 0.20 (benchmarks/quantize_minilm.py --speed; RESULTS.md, "GPTQ")
        return "kernels"
    if config.scheme.endswith("-weight-only") and device.type == "cpu" and dtype in CPU_KERNEL_DTYPES:
        # torch's CPU weight-only kernels on plain buffers (weight_only.cpu_kernels). A bf16 MLP at bs1
        # on the AVX2 dev CPU: int8 2.81 ms against torchao's 6.31, int4 2.42 against 2.79, dense bf16
        # 3.12 (benchmarks/quantization.py --part cpu-wo; RESULTS.md)
        return "kernels"
    return "torchao"


CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # models whose CPU weight-only layers are torchkiln's


def torchao_config(config: QuantConfig, device: torch.device):
    """The torchao ``quantize_`` config for a scheme (set_inductor_config=False: torchao would
    otherwise change global inductor settings for the whole process)."""
    q = torchao()
    s = config.scheme
    if s == "int8-weight-only":
        return q.Int8WeightOnlyConfig(set_inductor_config=False)
    if s == "int8-dynamic":
        return q.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if s == "fp8":
        from torchao.quantization.granularity import PerRow
        return q.Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    if s == "int4-weight-only":
        if device.type == "cuda":  # tinygemm's packed layout, the int4 CUDA kernel torch ships
            return q.Int4WeightOnlyConfig(group_size=config.group_size, int4_packing_format="tile_packed_to_4d",
                                          set_inductor_config=False)
        try:  # CPU: torch's _weight_int4pack_mm_for_cpu kernel behind torchao's opaque int4 tensor
            with _quiet_torchao():
                from torchao.prototype.quantization.int4.inference_workflow import (
                    PrototypeInt4WeightOnlyConfig,
                )
            return PrototypeInt4WeightOnlyConfig(group_size=config.group_size, set_inductor_config=False)
        except ImportError:  # older torchao: int4 values unpacked into int8 storage
            from torchao.quantization.granularity import PerGroup
            return q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(config.group_size))
    raise ValueError(f"scheme {s!r} does not run through torchao's quantize_")


def fast_here(scheme: str, device: torch.device, hw=None, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """(fast, why) for a scheme on a device; ``why`` suggests the scheme that is fast when not.
    ``hw``: the Hardware model (its probed CUDA capability is used, so no CUDA call is made here);
    ``dtype``: the model's floating dtype, where known."""
    if device.type == "cuda":
        acc = hw.accelerator(f"cuda:{device.index or 0}") if hw is not None else None
        cap = getattr(acc, "capability", None) if acc is not None else None
        if cap and str(cap).replace(".", "").isdigit():
            cc = tuple(int(v) for v in str(cap).split(".")[:2])
        else:
            cc = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else (0, 0)
        if scheme == "fp8":
            return (cc >= (8, 9), "fp8 GEMMs need compute capability >= 8.9; use int8-dynamic or int8-weight-only"
                    if cc < (8, 9) else "cuBLASLt fp8 GEMM, per-row scales")
        if scheme in ("int8-static", "int8-smoothquant"):
            return False, ("the static int8 flow lowers to oneDNN CPU kernels; on CUDA it runs as fake "
                           "quantization: use int8-dynamic or fp8")
        if scheme == "int8-weight-only":
            return True, "torchkiln's Triton int8 GEMV for up to 4 rows, a dequantizing matmul beyond"
        if scheme == "int4-weight-only":
            return True, "torch's tinygemm int4 kernel (bf16 models), torchkiln's Triton int4 GEMV otherwise"
        return True, "torchao CUDA kernels"
    if device.type != "cpu":
        return False, f"no quantized kernels for {device.type}; weight-only schemes save memory only"
    cpu = hw.cpu if hw is not None else None
    int8_dot = bool(cpu and cpu.int8_dot)
    avx512 = bool(cpu and cpu.has("avx512f"))
    if scheme == "fp8":
        return False, "fp8 needs a GPU with compute capability >= 8.9; on CPU use int8-static"
    if scheme in ("int8-static", "int8-smoothquant"):
        return True, "oneDNN int8 kernels" + (" with VNNI" if int8_dot else " (no VNNI: AVX2 int8)")
    if scheme == "int8-dynamic":
        return (int8_dot, "oneDNN int8 kernels with VNNI" if int8_dot else
                "without VNNI/AMX int8-dynamic is no faster than fp32 (MiniLM bs16: 206 vs 197 ms); use int8-static")
    if dtype in CPU_KERNEL_DTYPES:
        return True, "torch's CPU weight-only kernels on plain buffers (bf16/fp16 activations)"
    if scheme == "int4-weight-only":  # float32 (or unknown) models: the dequantizing expression
        return False, ("a float32 model's int4 layers dequantize inside the matmul on the CPU, which saves memory "
                       "but is no faster than float32 (MiniLM bs16: 0.23 vs 0.20 s); cast the model to bfloat16 "
                       "for torch's int4 kernel, or use int8-static")
    # weight-only on a float32 model: a win where decoding is memory-bound, with AVX-512 kernels
    return (avx512, "weight-only GEMV kernels (memory-bound decoding)" if avx512 else
            "without AVX-512 the weight-only kernels are slower than fp32 (int4 bs1 MLP: 9.8 vs 1.7 ms); "
            "use int8-static")


def fast_schemes(device: torch.device, hw=None) -> dict[str, tuple[bool, str]]:
    return {s: fast_here(s, device, hw) for s in SCHEMES}
