"""CPU choices: bf16 only with native hardware support, oneDNN vs BLAS GEMM by
measurement, inductor with freezing (constant-folds and prepacks weights)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..hardware import Hardware
from ..passes import onednn_graph, registry
from ..passes.onednn_linear import available as onednn_available
from ..passes.onednn_linear import hf_conv1d
from ..passes.onednn_linear import measure as onednn_measure
from ..recipe import Recipe
from .common import base_passes, is_hf

FREEZING_GEMM = "GEMM: oneDNN via inductor freezing"  # a low-precision plan's note (plan() drops it uncompiled)

# Below this many parameters a model compiles in seconds, and the C++ wrapper's own compile
# (13-20 s on 2 cores) would dominate optimize().
WRAPPER_MIN_PARAMS = 10_000_000


def choose_dtype(hw: Hardware, device: str, dtype: torch.dtype):
    if dtype == torch.bfloat16 and not hw.cpu.bf16_native:
        return torch.float32, ("bfloat16 requested but this CPU has no native bf16 (AVX512_BF16, "
                               "AMX or Arm BF16): bf16 would be emulated and slower; kept float32")
    if dtype == torch.float16 and not hw.cpu.fp16_native:
        return torch.float32, ("float16 requested but this CPU has no native fp16 compute "
                               "(AVX512_FP16/AMX-FP16): kept float32")
    return dtype, None


def gemm_choice(dtype: torch.dtype, m: int, k: int, n: int) -> tuple[str, dict]:
    """Measure, don't assume: which linear path is faster here for this dtype and shape, with
    the thread count the model will run with (inside tk.runtime.pin or a stream: the pool's).
    Cached per process (a few tens of milliseconds per shape and thread count)."""
    return _gemm_choice(dtype, m, k, n, torch.get_num_threads())


@functools.lru_cache(maxsize=32)
def _gemm_choice(dtype: torch.dtype, m: int, k: int, n: int, threads: int) -> tuple[str, dict]:
    if not onednn_available(dtype):
        return "aten", {}
    rates = onednn_measure(dtype, m, k, n)
    # A 10% margin: replacing modules is only worth it for a clear win.
    return ("onednn" if rates["onednn"] > 1.1 * rates["aten"] else "aten"), rates


def _typical_linear(model: nn.Module) -> tuple[int, int] | None:
    shapes = [(m.in_features, m.out_features) for m in model.modules() if type(m) is nn.Linear]
    shapes += [tuple(m.weight.shape) for m in model.modules() if hf_conv1d(m)]  # GPT-2's: (in, out)
    if not shapes:
        return None
    return max(set(shapes), key=lambda s: shapes.count(s) * s[0] * s[1])


def gemm_pass(model: nn.Module, dtype: torch.dtype, rows: int | None, notes: list[str]) -> list:
    """[the onednn_linear pass] where oneDNN's packed GEMM measured faster than aten's for the model's
    typical linear at its rows (batch x sequence for text), else []; the measurement goes into notes."""
    shape = _typical_linear(model)
    if not shape:
        return []
    m = max(16, min(rows or 128, 4096))
    gemm, rates = gemm_choice(dtype, m, *shape)
    if rates:
        notes.append(f"GEMM {str(dtype)[6:]} {m}x{shape[0]}x{shape[1]} measured: aten {rates['aten']} "
                     f"vs oneDNN {rates['onednn']} GFLOP/s -> {gemm}")
    if gemm != "onednn":
        return []
    return [registry.make("onednn_linear", shape=(m, *shape), aten_gflops=rates["aten"], onednn_gflops=rates["onednn"])]


def eager_gemm_pass(model: nn.Module, dtype: torch.dtype, rows: int | None, notes: list[str]) -> list:
    """gemm_pass for a low-precision recipe that will not compile (graph_mode=False, IPEX's eager
    mode): no inductor freezing then packs the linears, and aten's bf16 GEMM is the slow one (512x512
    on a 2-core Zen 4: 33 us against oneDNN's packed 20 at one row, 109 against 94 at 64 rows;
    RESULTS.md, thirty-fourth session)."""
    return gemm_pass(model, dtype, rows, notes) if dtype != torch.float32 else []


def plan(model, hw: Hardware, device, dtype, level, has_conv, batch, notes, rows=None) -> Recipe:
    passes, fmt = base_passes(dtype, model)
    if fmt == "channels_last":
        notes.append("conv net: channels_last (oneDNN's fastest conv layout)")
    if dtype != torch.float32:
        # inductor's freezing packs low-precision linears into oneDNN itself and fuses
        # GELU/residual post-ops into them; replacing the modules blocks that (bert-base
        # bf16 bs1, interleaved: 28.4 ms with our module vs 28.0 without; RESULTS.md).
        # Without compiling (graph_mode=False), plan() asks eager_gemm_pass instead.
        notes.append(f"{FREEZING_GEMM} ({str(dtype)[6:]}): packed, post-op fusion")
    else:
        passes += gemm_pass(model, dtype, rows or batch, notes)
    options = {"freezing": True}
    if dtype != torch.float32 and sum(p.numel() for p in model.parameters()) >= WRAPPER_MIN_PARAMS:
        # Inductor's C++ wrapper calls the kernels without Python between them: bert-base bf16
        # bs1 on a 2-core Zen 4, one process, interleaved: 1.045x, for 13 s more compiling
        # (RESULTS.md). float32 there: 1.00x (its GEMMs are onednn_linear's, which the wrapper
        # cannot call). Small models skip it: its compile would dominate optimize().
        options["cpp_wrapper"] = True
        notes.append("C++ wrapper (no Python between kernels)")
    if level == "O2":
        passes.append(registry.make("concat_linear"))
        notes.append("O2: concat sibling linears")
        # Less Python overhead per call. It cannot run onednn_linear's packed buffers; plan's
        # _apply_knobs drops it while that pass stays (after the knobs, which may remove it).
        if not options.get("cpp_wrapper"):
            options["cpp_wrapper"] = True
            notes.append("O2: C++ wrapper (less Python overhead per call)")
    # SDPA's CPU flash kernel parallelises over batch x heads only; at short
    # sequences plain math is often faster. Decided per shape by measurement.
    graph = has_conv and onednn_graph.available()
    if graph:
        # resnet50 fp32 bs1 on a 2-core Zen 3: 1.16x inductor's; timed per model, served only if fastest.
        notes.append("conv net: oneDNN Graph (fused conv partitions run from C++) timed as a candidate")
    return Recipe(device=device, dtype_mode="cast" if dtype != torch.float32 else "none",
                  passes=tuple(passes), memory_format=fmt, attention="auto", drop_all_ones_mask=is_hf(model),
                  compile=True, compile_options=tuple(sorted(options.items())), onednn_graph=graph,
                  notes=tuple(notes))
