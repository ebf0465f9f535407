"""``torchkiln::cuda_int4_mm_g<group>``: products of 1-32 rows with int4 weights on CUDA (bf16),
on the tensor cores, in a tile layout of its own (``pack``), an op written in CUDA C++ (cuda_int4.cu
says why) and built here on first use, one library per group size. For the decode step it also
takes the product's neighbours (``mm``'s norm, gated, bias and resid; llm/fused.py).

The build needs CUDA's compiler (nvcc: ``$CUDA_HOME/bin/nvcc``, on PATH, or /usr/local/cuda's) and
torch's headers; one build per group size used (11 kernel instances; one library of all three sizes,
15 instances, took 32 s on the H200 machine), once per machine, torch version and GPU architecture
(the library is cached: ``kernels/build.py``). Where it cannot be built (no nvcc, a compile error),
``load()`` says why and callers keep torch's own kernel (tinygemm) or the Triton ones.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch

from . import build

SOURCE = Path(__file__).with_name("cuda_int4.cu")
GROUPS = (64, 128, 256)
MAX_ROWS = 32  # rows of x per call: up to 4 blocks of the MMA's 8 columns, each tile converted once
CONFIGS = 8  # launch shapes the op offers (cuda_int4.cu CONFIGS); -1 is the first
# the launch shapes the folded forms are built at (cuda_int4.cu dispatch: the norm prologue at 3-4
# ring slots; gated pairs gate and up row blocks, RB 2)
FOLD_CONFIGS = {None: tuple(range(CONFIGS)), "norm": (0, 1, 2, 3, 4, 5, 7), "gated": (4, 5, 7)}
_lock = threading.Lock()


def _why_not_here(device: torch.device) -> str | None:  # a CUDA device (load() checked)
    if build.nvcc() is None:
        return "no CUDA compiler found (nvcc; set CUDA_HOME to the CUDA toolkit)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs compute capability 8.0 or later (bf16 tensor cores)"
    return None


def _flags(device: torch.device, group: int) -> list[str]:
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"{major}{minor}"
    # torch's own extension builds define these: c10's Half/BFloat16 and CUDA's operators would clash
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-DKILN_GROUP={group}", "-D__CUDA_NO_HALF_OPERATORS__",
            "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


def _no_cuda() -> str | None:
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "needs a CUDA build of torch and a CUDA device"
    return None


def unavailable(device: torch.device) -> str | None:
    """Why no library could be built for ``device`` (no CUDA, no nvcc, an old GPU), without building
    one; None if one could."""
    return _no_cuda() or _why_not_here(torch.device(device))


def load(device: torch.device | None = None, group: int = 128) -> str | None:
    """Register ``op(group)`` for ``device``'s architecture (default: the current CUDA device),
    building it if needed. None when it is ready; otherwise why not, in words."""
    why = _no_cuda()
    if why:
        return why
    if group not in GROUPS:
        return f"groups of {group} inputs: it takes {', '.join(map(str, GROUPS))}"
    device = torch.device(device) if device is not None else torch.device("cuda")
    return _load(torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index), group)


@functools.cache
def _load(device: torch.device, group: int) -> str | None:
    why = _why_not_here(device)
    if why:
        return why
    with _lock:
        try:
            torch.ops.load_library(str(build.build(SOURCE, _flags(device, group), ["-lc10", "-lc10_cuda",
                                                                                    "-ltorch_cpu", "-ltorch_cuda"])))
        except (OSError, RuntimeError) as e:
            return f"build failed: {e}"
        _register_fake(group)
    return None


def op(group: int):
    """The op for weights quantized in groups of ``group`` inputs (``load`` it first)."""
    return getattr(torch.ops.torchkiln, f"cuda_int4_mm_g{group}")


@functools.cache  # once per process and group: a second registration raises (two devices load one library)
def _register_fake(group: int) -> None:
    torch.library.register_fake(f"torchkiln::cuda_int4_mm_g{group}")(_fake)


def _fake(x, packed, scale_zero, config=-1, norm=None, eps=0.0, gated=False, bias=None, resid=None):
    return x.new_empty(*x.shape[:-1], 16 * packed.shape[0] // (2 if gated else 1))


# Which nibble of a tile's word each lane's values take: the mma.sync m16n8k16 A operand gives
# lane l (g = l // 4, t = l % 4) rows g and g + 8 at columns 2t, 2t + 1, 2t + 8, 2t + 9; the kernel
# turns nibbles i and i + 4 of its word into one register's bf16 pair (cuda_int4.cu ``pair``), so
# nibble i = 0..3 holds the pair's first column and i + 4 its second. Registers in order: (row g,
# cols 2t..), (row g + 8, cols 2t..), (row g, cols 2t + 8..), (row g + 8, cols 2t + 8..).
def _nibble_rows_cols() -> tuple[torch.Tensor, torch.Tensor]:
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    rows, cols = torch.empty(32, 8, dtype=torch.long), torch.empty(32, 8, dtype=torch.long)
    for i, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        rows[:, i] = rows[:, i + 4] = g + dr
        cols[:, i], cols[:, i + 4] = 2 * t + dc, 2 * t + dc + 1
    return rows, cols


def _columns() -> torch.Tensor:
    """Where each of a 64-column block's MMA columns reads x: tile j's column 2t + e (e = 0, 1) is
    x's column 16t + 4j + e and its column 2t + 8 + e is 16t + 4j + 2 + e, so that a lane's B
    operands for the block's 4 tiles are x's 16 consecutive values at 16t (two 16-byte loads)."""
    cols = torch.empty(64, dtype=torch.long)
    for j in range(4):
        for kk in range(16):
            t, e, high = (kk % 8) // 2, kk % 2, kk // 8
            cols[16 * j + kk] = 16 * t + 4 * j + 2 * high + e
    return cols


def pack(q: torch.Tensor) -> torch.Tensor:
    """int4 codes ``q`` (integers 0-15, [N, K], N % 16 == 0, K % 64 == 0) in the kernel's layout:
    int32 [N/16, K/64, 32, 4], the word of lane l for the 16 x 16 tile (row block b, column block c)
    at [b, c // 4, l, c % 4], each 64 columns in ``_columns()``'s order."""
    n, k = q.shape
    rows, cols = (i.to(q.device) for i in _nibble_rows_cols())
    q = q.view(n, k // 64, 64)[:, :, _columns().to(q.device)]
    tiles = q.to(torch.int32).view(n // 16, 16, k // 16, 16).permute(0, 2, 1, 3)  # [b, c, 16, 16]
    nib = tiles[:, :, rows, cols]  # [b, c, 32 lanes, 8 nibbles]
    word = (nib << (4 * torch.arange(8, device=q.device))).sum(-1, dtype=torch.int64)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return word.view(n // 16, k // 64, 4, 32).transpose(2, 3).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: the codes [N, K] (uint8), in a few elementwise passes and one permuted copy
    (int4 calls of more than 64 rows dequantize through it for cuBLAS: an index-scatter form through
    int64 made Llama-3-8B's 128-row prefill take 224 ms against bf16's 13 on the H200). Nibble i of
    lane (g, t)'s word for tile j of a 64-column block sits at row g + 8 (i & 1) of its row block and
    column 16t + 4j + 2 ((i >> 1) & 1) + (i >> 2) of the block (``_nibble_rows_cols``, ``_columns``)."""
    b, c4 = packed.shape[:2]
    nib = torch.stack([((packed >> (4 * i)) & 0xF).to(torch.uint8) for i in range(8)])  # [i, b, c4, lane, j]
    nib = nib.view(2, 2, 2, b, c4, 8, 4, 4)  # i as (i >> 2, (i >> 1) & 1, i & 1); lane as (g, t)
    return nib.permute(3, 2, 5, 4, 6, 7, 1, 0).reshape(16 * b, 64 * c4)  # [b, i & 1, g, c4, t, j, ...]


def pack_scales(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Per-group ``scale`` and ``zero`` ([N, K / group], bf16) as the kernel reads them: int32
    [N/16, K / group, 16], per 16 rows and group the rows' (scale, zero) bf16 pairs (scale in the
    low half): one 64-byte copy per row block and group."""
    n, groups = scale.shape
    bits = [t.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF for t in (scale, zero)]
    word = bits[0] | (bits[1] << 16)  # int32 arithmetic wraps: the zero's sign bit lands in bit 31
    return word.view(n // 16, 16, groups).transpose(1, 2).contiguous()


def unpack_scales(scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_scales``' inverse: (scale, zero), each bf16 [N, K / group]."""
    blocks, groups, _ = scale_zero.shape
    words = scale_zero.transpose(1, 2).reshape(16 * blocks, groups)
    halves = [(words & 0xFFFF).to(torch.int16), ((words >> 16) & 0xFFFF).to(torch.int16)]
    return tuple(h.view(torch.bfloat16) for h in halves)


def fits(n: int, k: int, group: int, dtype: torch.dtype) -> bool:
    """Can the op hold a layer of this shape, group and dtype?"""
    return dtype == torch.bfloat16 and n % 16 == 0 and k % 64 == 0 and group in GROUPS and k % group == 0


@functools.cache  # defined once per process
def folded_op():
    """``mm``'s folded forms as a Python custom op around ``op(group)``, for compiled decode steps
    (llm/fused.py), as the int8 folded ops are: x and resid of any shape holding their rows."""

    @torch.library.custom_op("torchkiln::cuda_int4_folded", mutates_args=())
    def folded(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, config: int,
               norm: torch.Tensor | None, eps: float, gated: bool, bias: torch.Tensor | None,
               resid: torch.Tensor | None) -> torch.Tensor:
        return op(group)(x, packed, scale_zero, config, norm, eps, gated, bias, resid)

    @folded.register_fake
    def _(x, packed, scale_zero, group, config, norm, eps, gated, bias, resid):
        return _fake(x, packed, scale_zero, config, norm, eps, gated, bias, resid)

    return folded


def mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, config: int = -1,
       norm: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False, bias: torch.Tensor | None = None,
       resid: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` for 1-32 rows of x (``load()`` first), w = q * scale + zero per group of ``group``
    inputs, q in ``pack``'s layout, scale and zero in ``pack_scales``'. The decode step's neighbours,
    each optional (one row of x with ``norm``): ``norm`` (float32 [K]) and ``eps``: x RMS-normalised
    and scaled by ``norm`` first; ``gated``: w's first half of rows are gates and the second the
    same outputs' up rows, and the result is silu(gate) * up (half as wide); ``bias`` ([N], before
    the gate) and ``resid`` (the result's shape) added. Bad operands raise ValueError here, naming
    what is wrong."""
    why = _bad_operands(x, packed, scale_zero, group, config) or _bad_fold(x, packed, norm, gated, bias, resid)
    if why:
        raise ValueError(f"torchkiln::cuda_int4_mm: {why}")
    return op(group)(x, packed, scale_zero, config, norm, eps, gated, bias, resid)


def _bad_fold(x, packed, norm, gated, bias, resid) -> str | None:
    n, k = 16 * packed.shape[0], 64 * packed.shape[1]
    rows = x.numel() // k
    if norm is not None and (rows != 1 or norm.dtype != torch.float32 or tuple(norm.shape) != (k,)):
        return f"norm takes one row of x and a float32 [{k}] scale, got {rows} rows and {norm.dtype} {tuple(norm.shape)}"
    if gated and (n % 32 or rows > 8):
        return f"gated needs a multiple of 32 rows of weights ({n}) and at most 8 rows of x ({rows})"
    out = (rows, n // 2 if gated else n)
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.numel() != n):
        return f"bias must be bf16 with {n} values, got {bias.dtype} {tuple(bias.shape)}"
    if resid is not None and (resid.dtype != torch.bfloat16 or resid.numel() != out[0] * out[1]
                              or not resid.is_contiguous()):
        return f"resid must be a contiguous bf16 tensor of the result's {out[0] * out[1]} values, got {tuple(resid.shape)}"
    return None


def _bad_operands(x, packed, scale_zero, group, config) -> str | None:
    if not (x.is_cuda and packed.is_cuda and scale_zero.is_cuda):
        return f"CUDA tensors only (x on {x.device}, packed on {packed.device})"
    if x.dtype != torch.bfloat16:
        return f"x must be bfloat16, got {x.dtype}"
    if packed.dtype != torch.int32 or packed.dim() != 4 or tuple(packed.shape[2:]) != (32, 4) \
            or not packed.is_contiguous():
        return f"packed must be pack()'s contiguous int32 [N/16, K/64, 32, 4], got {packed.dtype} {tuple(packed.shape)}"
    n, k = 16 * packed.shape[0], 64 * packed.shape[1]
    if x.shape[-1] != k or not 1 <= x.numel() // k <= MAX_ROWS or not x.is_contiguous():
        return f"x must be 1-{MAX_ROWS} contiguous rows of {k} values, got sizes {tuple(x.shape)}"
    if group not in GROUPS or k % group:
        return f"group must be one of {GROUPS} dividing K = {k}, got {group}"
    want = (n // 16, k // group, 16)
    if scale_zero.dtype != torch.int32 or tuple(scale_zero.shape) != want or not scale_zero.is_contiguous():
        return (f"scale_zero must be pack_scales()' contiguous int32 {list(want)}, got {scale_zero.dtype} "
                f"sizes {tuple(scale_zero.shape)}")
    if not -1 <= config < CONFIGS:
        return f"config must be -1 (the first) or 0-{CONFIGS - 1}, got {config}"
    return None


_TUNED: dict = {}  # (N, K, group, device, fold) -> the fastest config


def tune(n: int, k: int, group: int, device: torch.device, fold: str | None = None) -> int:
    """The fastest launch shape for one-row calls on an N x K weight (timed once per shape and
    device, on zero weights: the time depends on the shape only), among FOLD_CONFIGS[fold]: None the
    plain product, "norm" with the norm prologue, "gated" with it and the gated epilogue. Copies of
    the weight totalling >= 128 MB are cycled so that it is not read from L2. Not inside a
    CUDA-graph capture."""
    key = (n, k, group, device, fold)
    if key not in _TUNED:
        copies = max(2, -(-(128 << 20) // (n * k // 2)))
        packed = [torch.zeros(n // 16, k // 64, 32, 4, dtype=torch.int32, device=device) for _ in range(copies)]
        one = torch.ones(n, k // group, dtype=torch.bfloat16, device=device)
        scale_zero = pack_scales(one, one)
        x = torch.randn(1, k, dtype=torch.bfloat16, device=device)
        extra = () if fold is None else (torch.ones(k, device=device), 1e-6, fold == "gated")
        call = op(group)
        times = {}
        for config in FOLD_CONFIGS[fold]:  # each inside a CUDA graph: eager calls would time the launches
            for p in packed:  # warm-up
                call(x, p, scale_zero, config, *extra)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for p in packed:
                    call(x, p, scale_zero, config, *extra)
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            end.synchronize()
            times[config] = start.elapsed_time(end)
            del graph
        _TUNED[key] = min(times, key=times.get)
        del packed
    return _TUNED[key]
