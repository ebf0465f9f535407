"""CUDA (and ROCm) choices: bf16/fp16 by compute capability, channels_last and
autotuned cuDNN algorithms for conv nets, inductor with freezing (constant
folding, conv-bn folding and sibling-matmul concatenation on GPU), CUDA graphs
when a sample input fixes the shapes, and at O2 max-autotune."""

from __future__ import annotations

import torch

from ..hardware import Hardware
from ..recipe import Recipe

SMALL_BATCH = 16


def choose_dtype(hw: Hardware, device: str, dtype: torch.dtype):
    acc = hw.accelerator(device)
    if acc is None or dtype == torch.float32:
        return dtype, None
    native = {torch.bfloat16: acc.bf16, torch.float16: acc.fp16}.get(dtype)
    if native is False:
        return torch.float32, (f"{dtype} requested but {acc.name} (capability {acc.capability}) "
                               f"does not run it natively; kept float32")
    return dtype, None


def plan(model, hw: Hardware, device, dtype, level, has_conv, batch, notes) -> Recipe:
    passes = {"replace_dropout", "fold_conv_bn", "fold_linear_bn"}
    if dtype != torch.float32:
        passes.add("cast_dtype")
    fmt = "contiguous"
    if has_conv:
        passes.add("channels_last")
        fmt = "channels_last"
        notes.append("conv net: channels_last (cuDNN's tensor-core conv layout), cuDNN autotuned algorithms")
    options: dict = {"freezing": True}
    graphs = False
    if level == "O2":
        options["max_autotune"] = True
        notes.append("O2: max-autotune GEMM/conv selection (slow first compile, cached on disk)")
        # Graph replay removes per-kernel launch cost, which matters when kernels are
        # short. At bert-base bf16 bs64 on the H200 it changed nothing measurable
        # (3.69 vs 3.69 ms), and it serialises calls, so only small batches get it.
        if batch is not None and batch <= SMALL_BATCH:
            graphs = True
            options["triton.cudagraphs"] = True
            notes.append(f"O2: batch {batch} <= {SMALL_BATCH}: CUDA graphs remove kernel-launch overhead")
    return Recipe(device=device, dtype_mode="cast" if dtype != torch.float32 else "none",
                  fp32_modules=(), passes=tuple(passes), memory_format=fmt, gemm="aten", cudnn_benchmark=has_conv,
                  cuda_graphs=graphs,
                  compile=True, compile_options=tuple(sorted(options.items())), freezing=True,
                  notes=tuple(notes) + (("CUDA norm/softmax kernels accumulate in fp32 already: "
                                         "no fp32 islands needed",) if dtype != torch.float32 else ()))
