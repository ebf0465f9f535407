"""CUDA (and ROCm) choices: bf16/fp16 by compute capability, channels_last and
autotuned cuDNN algorithms for conv nets, inductor with freezing (constant
folding, conv-bn folding and sibling-matmul concatenation on GPU), GELU in the
GEMM epilogue in half precision, CUDA graphs when a sample input fixes the
shapes, and at O2 max-autotune."""

from __future__ import annotations

import torch

from ..hardware import Hardware
from ..passes import registry
from ..recipe import Recipe
from .common import base_passes, is_hf


def choose_dtype(hw: Hardware, device: str, dtype: torch.dtype):
    acc = hw.accelerator(device)
    if acc is None or dtype == torch.float32:
        return dtype, None
    native = {torch.bfloat16: acc.bf16, torch.float16: acc.fp16}.get(dtype)
    if native is False:
        return torch.float32, (f"{dtype} requested but {acc.name} (capability {acc.capability}) "
                               f"does not run it natively; kept float32")
    return dtype, None


# CUDA norm/softmax kernels accumulate in fp32 already: no fp32 islands needed.
FP32_ISLANDS = False


def plan(model, hw: Hardware, device, dtype, level, has_conv, batch, notes, rows=None) -> Recipe:
    passes, fmt = base_passes(dtype, model, islands=FP32_ISLANDS)
    if has_conv:
        notes.append("conv net: cuDNN autotuned algorithms")
    if fmt == "channels_last":
        notes.append("conv net: channels_last (cuDNN's tensor-core conv layout)")
        if dtype in (torch.bfloat16, torch.float16):
            # The tensor-core kernels want 8 input channels (passes/pad_conv_channels.py has the figures).
            passes.append(registry.make("pad_conv_channels"))
    options: dict = {"freezing": True}
    # CUDA-graph replay removes per-kernel launch cost. Measured on the H200,
    # bert-base bf16, interleaved in one process (benchmarks/cuda_graphs.py):
    # bs1 2.385 -> 0.687 ms, bs64 4.532 -> 3.794 ms. It needs static shapes,
    # which a sample input provides; without one, shapes are unknown: no graphs.
    graphs = batch is not None
    if graphs:
        options["triton.cudagraphs"] = True
        notes.append("sample input fixes the shapes: CUDA graphs remove kernel-launch overhead")
    if graphs and not has_conv:
        # Inductor's freezing concatenates Q/K/V GEMMs too, but after tracing: the opaque
        # attention op then gets 3 copy kernels per layer to restore the traced strides.
        # Fused before tracing, q/k/v are views of one GEMM output (needs the sample run).
        passes.append(registry.make("concat_linear"))
        notes.append("sibling linears (Q/K/V) fused into one GEMM before tracing: no split copies")
    if dtype in (torch.bfloat16, torch.float16):
        # cuBLASLt's bias+GELU epilogue: H200, bert-base bf16, interleaved, bs64 3.47 -> 3.12 ms,
        # bs1 0.78 -> 0.71 (benchmarks/diag_gelu_epilogue.py). Its tanh-form GELU is within ~5e-4 of
        # the exact one: below half precision's rounding, not float32's 1e-4 bar, hence half only.
        passes.append(registry.make("gelu_epilogue"))
        notes.append("GELU after a linear runs in cuBLASLt's GEMM epilogue (tanh form, half precision only)")
    if level == "O2":
        options["max_autotune"] = True
        notes.append("O2: max-autotune GEMM/conv selection (slow first compile, cached on disk)")
    # Under torch.compile a traced attention mask makes inductor decompose SDPA into a
    # math kernel, losing the flash/cuDNN kernel eager runs (H200, bert-base bf16 bs64:
    # eager 3.76 ms, compiled 5.24 ms, from the trust issue). An opaque op keeps eager's
    # kernel choice, and an all-ones mask is dropped so flash applies at all.
    notes.append("attention: SDPA as an opaque op (keeps flash/cuDNN kernels under compile)")
    return Recipe(device=device, dtype_mode="cast" if dtype != torch.float32 else "none",
                  passes=tuple(passes), memory_format=fmt, cudnn_benchmark=has_conv,
                  cuda_graphs=graphs, attention="opaque", drop_all_ones_mask=is_hf(model),
                  compile=True, compile_options=tuple(sorted(options.items())), notes=tuple(notes))
