"""Weight-only int8/int4 linears on plain buffers, and the kernels that serve them.

Shared by tk.quantize (backend "kernels": weight-only on CUDA, int4 on the CPU, int8 on bf16/fp16
CPU models; with GPTQ's codes where gptq.py chose them) and the LLM path (llm/quant.py). Which
kernel serves a call:
- CUDA int8, and int4 where tinygemm does not fit: calls of at most gemv.MAX_ROWS rows (decode,
  batch-1 inference) run the hand-written Triton GEMVs in gemv.py. torchao's Int8WeightOnlyConfig
  decoded Llama-3-8B at 136 tok/s on the H200 against 250 for these (benchmarks/RESULTS.md, LLM
  decode), and through its tensor subclass the int4 kernel left the GPU idle 2-4 ms per token.
  CUDA int8 calls of 2 to gemv.WIDE_ROWS rows in bf16/fp16 (batched decode, prefill) run gemv.py's
  int8 matmul instead.
- int4 in bf16 on CUDA, and int8/int4 in bf16/fp16 on the CPU: torch's own weight-only kernels
  (tinygemm, _weight_int8pack_mm), for every call except CUDA int4 calls of more than
  TINYGEMM_ROWS rows, which dequantize tinygemm's tiles and run cuBLAS.
- Otherwise (float32, wider CUDA calls, the int4 Triton layout's prefill) the weight is
  dequantized inside the matmul expression (gpt-fast's form).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cuda_int4
from . import fallback, gemv
from .config import QuantConfig
from .schemes import CPU_KERNEL_DTYPES

TINYGEMM_TILES = 8  # tinygemm's inner K tiles: the input width must be a multiple of 16 x this
# CUDA calls of more rows than this dequantize tinygemm's layout to a dense weight for cuBLAS instead
# (gemv.tinygemm_dense; a transient bf16 copy of the layer's weight). tinygemm's time grows by about
# one pass over the weight per 8-16 rows; on the H200 at Llama-3-8B's q/k/v, gate/up and down shapes
# it was 0.8-0.85x the dense form at 32 rows, 1.08-1.25x at 48, 1.6-5.9x at 64-256
# (benchmarks/diag_rows.py; RESULTS.md, "int4 and int8 at batch > 1").
TINYGEMM_ROWS = 40
# calls of up to this many rows run torchkiln's CUDA int4 kernel (32 rows a launch) in the mma layout;
# wider ones dequantize for cuBLAS
MMA_ROWS = 64
KERNEL_SCHEMES = ("int8-weight-only", "int4-weight-only")  # what backend "kernels" serves


def cpu_kernels(weight: torch.Tensor) -> bool:
    """Do torch's own CPU weight-only kernels (``aten._weight_int8pack_mm``, and
    ``_weight_int4pack_mm_for_cpu`` where this torch has it) serve a layer with this weight? Only
    for bf16/fp16 activations. On this project's AVX2 dev CPU, with llama-350m's shapes and weights
    from DRAM, against dense bf16: int8 1.12-1.52x at one row and 2.6-3.0x at four, int4 1.05-1.53x
    and 2.3-2.8x; in float32 the int8 kernel ran 0.12-0.42x dense float32, so float32 layers keep the
    expression (benchmarks/llm_gemv_cpu.py; RESULTS.md, "LLM decode on the CPU, 2026-11-22")."""
    return weight.device.type == "cpu" and weight.dtype in CPU_KERNEL_DTYPES


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """Int8Linear's grid: one symmetric scale per output channel (float32)."""
    return w.detach().float().abs().amax(dim=1).clamp_min(1e-8) / 127.0


def int4_grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Linear's grid: per group of ``group`` inputs, (scale, lo) with ``w = q * scale + lo``,
    q in 0-15 spanning the group's min to max (float32, [n, k // group] each)."""
    n, k = w.shape
    g = w.detach().float().view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    return ((hi - lo) / 15).clamp_min(1e-8), lo


_TILE_ORDER: dict = {}  # device -> which nibble of a tinygemm tile holds each of its 8 x 128 values


def _tile_order(device: torch.device) -> torch.Tensor:
    """For tinygemm's CUDA layout (inner K tiles 8: int32 [N/8, K/128, 32, 4], each 8 x 128 tile of
    the weight in 128 consecutive words), the value index (row * 128 + column) that each of a
    tile's 1024 nibbles holds. Read off torch's own packing of three probe tiles, each carrying 4
    bits of every value's index, rather than restating its fragment layout here."""
    if device not in _TILE_ORDER:
        idx = torch.arange(1024, device=device).view(8, 128)
        src = torch.zeros(1024, dtype=torch.int64, device=device)
        for b in range(3):
            q = ((idx >> (4 * b)) & 0xF).to(torch.uint8)
            words = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4) | q[:, 1::2], TINYGEMM_TILES)
            nib = (words.reshape(128, 1) >> torch.arange(0, 32, 4, device=device)) & 0xF
            src |= nib.reshape(1024).long() << (4 * b)
        _TILE_ORDER[device] = torch.argsort(src).int()  # value index -> the nibble that holds it
    return _TILE_ORDER[device]


class Int8Linear(nn.Module):
    """int8 weights, one scale per output channel: ``y = (x @ q.T) * scale + bias``. ``codes``:
    (int8 codes, scales) chosen elsewhere (GPTQ) on this grid; by default the nearest values."""

    def __init__(self, linear: nn.Linear, codes: tuple | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = gemv.wanted(linear.weight)  # the Triton GEMV serves CUDA decode
        self.cpu_kernel = cpu_kernels(linear.weight)  # torch's int8 kernel serves the CPU in bf16/fp16
        if codes is None:
            scales = int8_scales(linear.weight)
            q = torch.round(linear.weight.detach().float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
        else:
            q, scales = codes
        self.register_buffer("weight", q.to(linear.weight.device))
        self.register_buffer("scales", scales.to(linear.weight.device, linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        # one-row calls through torchkiln's CPU GEMV (kernels/cpu_gemv.cpp); set by whoever measured
        # it faster here (the LLM path's compiled CPU decode: llm/quant.py cpu_int8_rows)
        self.row_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_kernel and x.shape[:-1].numel() == 1:
            out = torch.ops.torchkiln.cpu_gemv(x, self.weight, self.scales)
        elif self.kernel and (gemv.usable(x, self.in_features) or gemv.wide(x, self.in_features)):
            out = gemv.int8_linear(x, self.weight, self.scales)
        else:
            out = self.product(x, self.weight, self.scales, self.cpu_kernel)
        return out + self.bias if self.bias is not None else out

    @staticmethod
    def product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, cpu_kernel: bool) -> torch.Tensor:
        """``(x @ weight.T) * scales`` with torch's own ops: its CPU int8 kernel where it serves, else
        the weight dequantized inside the expression."""
        if cpu_kernel and x.dtype == scales.dtype:
            out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, weight.shape[1]), weight, scales)
            return out.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight.to(x.dtype)) * scales

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, per-channel scales"


class Int4Linear(nn.Module):
    """Asymmetric int4 weights in groups (128 by default) along the input, ``w = q * scale + zero``.

    Three layouts. ``mma=True`` (CUDA in bf16, where nvcc builds torchkiln's kernel; tk.llm's default,
    llm/quant.py INT4_IMPL): kernels/cuda_int4.py's tile layout and pack_scales' (scale, zero) pairs,
    calls of up to MMA_ROWS rows through that kernel. ``tinygemm=True`` (CUDA in bf16, or the CPU in
    bf16 where torch has its CPU kernel): tinygemm's packed tiles and its [groups, N, 2] scale-and-zero table, whose zero is the
    value of q = 8 (``zero + 8 * scale`` here), for every call on the CPU and CUDA calls of up to
    TINYGEMM_ROWS rows; wider CUDA calls dequantize the tiles for cuBLAS (gemv.tinygemm_dense).
    Otherwise two values per byte: in each group the low nibbles hold its first half of
    columns, the high nibbles its second half (the layout the Triton GEMV reads; see gemv.py);
    elsewhere unpacked and scaled inside the matmul expression like Int8Linear. ``codes``:
    (uint8 codes [n, k], scale, lo) chosen elsewhere (GPTQ) on int4_grid's grid; by default the
    nearest values."""

    def __init__(self, linear: nn.Linear, group: int = 128, tinygemm: bool = False, codes: tuple | None = None,
                 mma: bool = False):
        super().__init__()
        self.in_features = linear.in_features
        self.tinygemm = tinygemm and not mma
        self.mma = mma
        self.kernel = not tinygemm and not mma and gemv.wanted(linear.weight)
        n, k = linear.weight.shape
        if codes is None:
            scale, lo = int4_grid(linear.weight, group)
            g = linear.weight.detach().float().view(n, k // group, group)
            q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        else:
            q, scale, lo = (t.to(linear.weight.device) for t in codes)
            q = q.view(n, k // group, group)
        if mma:  # torchkiln's CUDA kernel (kernels/cuda_int4.cu): its tile layout, scale and zero paired
            self.register_buffer("packed", cuda_int4.pack(q.view(n, k)))
            self.register_buffer("scale_zero", cuda_int4.pack_scales(scale, lo))
            self.config = cuda_int4.tune(n, k, group, linear.weight.device)  # one-row launch shape
        elif tinygemm:
            q = q.view(n, k)
            if linear.weight.is_cuda:
                pairs = (q[:, ::2] << 4) | q[:, 1::2]  # the byte form the CUDA packing takes
                packed = torch.ops.aten._convert_weight_to_int4pack(pairs, TINYGEMM_TILES)
                if gemv.wanted(linear.weight):  # wide calls dequantize through gemv.tinygemm_dense
                    self.register_buffer("order", _tile_order(packed.device), persistent=False)
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), TINYGEMM_TILES)
            self.register_buffer("packed", packed)
            table = torch.stack((scale, lo + 8 * scale), dim=-1).transpose(0, 1)
            self.register_buffer("scale_zero", table.contiguous().to(linear.weight.dtype))
        else:
            half = group // 2
            self.register_buffer("packed", (q[..., :half] | (q[..., half:] << 4)).reshape(n, k // 2))
            self.register_buffer("scale", scale.to(linear.weight.dtype))
            self.register_buffer("zero", lo.to(linear.weight.dtype))
        self.out_features = n
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.group = group

    @staticmethod
    def fits_tinygemm(linear: nn.Linear, group: int) -> bool:
        w = linear.weight
        here = w.is_cuda or (w.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))
        return (here and w.dtype == torch.bfloat16 and w.shape[0] % (8 if w.is_cuda else 16) == 0
                and w.shape[1] % (16 * TINYGEMM_TILES) == 0 and group in (32, 64, 128, 256))

    @staticmethod
    def fits_mma(linear: nn.Linear, group: int) -> bool:
        """Can torchkiln's CUDA int4 kernel hold this layer (bf16 on CUDA, its shape; built here)?"""
        w = linear.weight
        return (w.is_cuda and cuda_int4.fits(w.shape[0], w.shape[1], group, w.dtype)
                and cuda_int4.load(w.device, group) is None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mma:
            out = self._mma(x)
        elif self.tinygemm and x.is_cuda and x.shape[:-1].numel() > TINYGEMM_ROWS and hasattr(self, "order"):
            out = F.linear(x, gemv.tinygemm_dense(self.packed, self.scale_zero, self.order, self.group))
        elif self.tinygemm:
            rows = x.reshape(-1, self.in_features).contiguous()
            mm = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
            out = mm(rows, self.packed, self.group, self.scale_zero)
            out = out.view(*x.shape[:-1], self.out_features)
        elif self.kernel and gemv.usable(x, self.in_features):
            out = gemv.int4_linear(x, self.packed, self.scale, self.zero, self.group)
        else:
            n, k = self.packed.shape[0], 2 * self.packed.shape[1]
            p = self.packed.view(n, k // self.group, self.group // 2)
            out = F.linear(x, self._dense(torch.stack((p & 0xF, p >> 4), dim=2), x.dtype, self.scale, self.zero))
        return out + self.bias if self.bias is not None else out

    def _mma(self, x: torch.Tensor) -> torch.Tensor:
        """The mma layout: calls of up to MMA_ROWS rows through the kernel, 32 rows a launch, every
        launch with the layer's warps (its launch shape's), so that a row's sums run in the same order
        whatever the batch; wider ones (long prompts) dequantize the weight for cuBLAS."""
        k, n = self.in_features, self.out_features
        rows = x.reshape(-1, k)
        if x.is_cuda and x.dtype == torch.bfloat16 and rows.shape[0] <= MMA_ROWS:
            mm = cuda_int4.op(self.group)
            parts = [mm(rows[i:i + cuda_int4.MAX_ROWS].contiguous(), self.packed, self.scale_zero, self.config)
                     for i in range(0, rows.shape[0], cuda_int4.MAX_ROWS)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            scale, zero = cuda_int4.unpack_scales(self.scale_zero)
            out = F.linear(rows, self._dense(cuda_int4.unpack(self.packed), x.dtype, scale, zero))
        return out.view(*x.shape[:-1], n)

    def _dense(self, q: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """The float weight [N, K] from the codes (any shape holding each row's K values in column
        order), ``q * scale + zero`` per group."""
        n, k = self.out_features, self.in_features
        q = q.reshape(n, k // self.group, self.group)
        return (q.to(dtype) * scale[..., None] + zero[..., None]).view(n, k)


def apply(model: nn.Module, config: QuantConfig, device: torch.device, codes: dict | None = None) -> None:
    """The weight-only schemes with the layers above: each targeted Linear of ``model``
    (torchkiln's copy), the kept ones aside, becomes an Int8Linear, or an Int4Linear in tinygemm's
    layout where it fits (bf16 on CUDA or, with torch's CPU kernel, the CPU), on ``device``.
    ``codes``: name -> the layer's codes (gptq.codes_for); other layers round to nearest."""
    if config.scheme not in KERNEL_SCHEMES:
        raise ValueError(f"backend 'kernels' serves {' and '.join(KERNEL_SCHEMES)} only, not {config.scheme!r}")
    mods = dict(model.named_modules())
    for name in set(fallback.targets(model, config, "kernels")) - set(config.keep):
        layer = mods[name].to(device)
        mine = (codes or {}).get(name)
        if config.scheme == "int8-weight-only":
            new = Int8Linear(layer, codes=mine)
        else:
            new = Int4Linear(layer, config.group_size, tinygemm=Int4Linear.fits_tinygemm(layer, config.group_size),
                             codes=mine)
        parent, _, attr = name.rpartition(".")
        setattr(mods[parent] if parent else model, attr, new.train(layer.training))
