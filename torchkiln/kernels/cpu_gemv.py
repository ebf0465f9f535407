"""``torchkiln::cpu_gemv``: batch-1 projections on x86 CPUs (float32, bfloat16 and int8 weights),
an op written in C++ (cpu_gemv.cpp says why) and built here on first use.

The build needs what torch.compile needs on a CPU anyway: a C++ compiler (``$CXX``, else ``c++``)
and torch's headers. It takes about 10 s on 2 cores, once per machine and torch version: the
library is cached (``kernels/build.py``). Where it cannot be built (another ISA, no AVX2, no
compiler, a compile error), ``load()`` says why and callers keep torch's own kernels.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
from pathlib import Path

import torch

from . import build

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
X_DTYPES = (torch.float32, torch.bfloat16)
W_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_lock = threading.Lock()


def _compiler() -> str | None:
    return build.compiler()


def _why_not_here() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"x86-64 only (this machine: {platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"needs AVX2 and FMA (this CPU's ATen capability: {capability})"
    if _compiler() is None:
        return f"no C++ compiler found ({os.environ.get('CXX') or 'c++'} is not on PATH)"
    return None


def _build() -> Path:
    # -fopenmp: at::parallel_for is inline OpenMP; the libgomp already loaded by torch serves it
    return build.build(SOURCE, ["-mavx2", "-mfma", "-fopenmp"], ["-lc10", "-ltorch_cpu"])


@functools.cache
def load() -> str | None:
    """Register ``torch.ops.torchkiln.cpu_gemv`` (building it if needed). None when it is ready;
    otherwise why not, in words (the op is then absent and callers use torch's kernels)."""
    why = _why_not_here()
    if why:
        return why
    with _lock:
        try:
            torch.ops.load_library(str(_build()))
        except (OSError, RuntimeError) as e:
            return f"build failed: {e}"
    torch.library.register_fake("torchkiln::cpu_gemv")(_fake)
    return None


def _fake(x, w, scale=None):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def fits(x_dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Can the op serve a layer with this weight for inputs of ``x_dtype``?"""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in W_DTYPES and x_dtype in X_DTYPES)


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ weight.T) * scale`` in x's dtype, accumulated in float32 (``load()`` first).
    Bad operands raise ValueError here, before the op, naming what is wrong; the op's own checks stay
    as a backstop (their throw once crashed on the H200 image: cpu_gemv.cpp says why)."""
    why = _bad_operands(x, weight, scale)
    if why:
        raise ValueError(f"torchkiln::cpu_gemv: {why}")
    return torch.ops.torchkiln.cpu_gemv(x, weight, scale)


def _bad_operands(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> str | None:
    if x.device.type != "cpu" or w.device.type != "cpu":
        return f"CPU tensors only (x on {x.device}, weight on {w.device})"
    if w.dim() != 2 or not w.is_contiguous():
        return f"weight must be a contiguous 2-D tensor, got sizes {tuple(w.shape)} strides {w.stride()}"
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        return f"x's last dim must be {w.shape[1]} (the weight's in_features), got sizes {tuple(x.shape)}"
    if x.dtype not in X_DTYPES:
        return f"x must be float32 or bfloat16, got {x.dtype}"
    if w.dtype not in W_DTYPES:
        return f"weight must be float32, bfloat16 or int8, got {w.dtype}"
    if w.dtype == torch.int8 and scale is None:
        return "int8 weights need scale (one float per output row)"
    if scale is not None and scale.numel() != w.shape[0]:
        return f"scale must hold {w.shape[0]} values, got {scale.numel()}"
    return None
