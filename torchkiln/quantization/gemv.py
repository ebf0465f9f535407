"""Weight-only int8/int4 GEMVs for the CUDA decode step, hand-written in Triton (and a float
one-row GEMV, measured against cuBLAS per model: see _float_one).

Why hand-written: on the H200, Llama-3-8B decode with int8 weights dequantized inside the
matmul expression (gpt-fast's form, fused by inductor into a reduction kernel) read its weights
at ~1.5 TB/s, half the 3.2 TB/s of the bf16 GEMVs, so int8 decoded no faster than bf16.
torchao's Int8WeightOnlyConfig was slower still (136 tok/s against bf16's 185) and its int4
kernel (tinygemm) read at ~1.4 TB/s (benchmarks/RESULTS.md, "LLM decode"). Neither torch nor
torchao ships a batch-1 kernel that streams 1- or 0.5-byte weights at the bandwidth limit.

The kernels stream the weight once, in wide row-major tiles, and dequantize in registers:
- int8: one scale per output row (symmetric), ``y = (x @ q.T) * scale``;
- int4: asymmetric groups of G inputs, ``w = q * scale + zero``, two values per byte with the
  low nibble column j of a group and the high nibble column j + G/2 (so both halves meet
  contiguous slices of x). Per group the kernel sums ``q * x`` and applies scale and zero once.

One-row calls read the weights as 32-bit words (fewer integer operations per value; see the
kernels). int8 calls of 2 to WIDE_ROWS rows in bf16/fp16 (decode batches, prefill) run a tensor-core
matmul kernel; otherwise all rows of x (at most MAX_ROWS) go through one program per weight tile, so
the weight is read once; wider inputs take the matmul expression instead. Registered
as custom ops (``torchkiln::``), so torch.compile and CUDA graphs see one opaque call; the launch
configuration is tuned per weight shape on first use, which ``warm()`` does before any graph is
captured.
"""

import functools
import importlib.util

import torch

MAX_ROWS = 4  # decode rows served by the GEMVs
# int8 calls of up to this many rows (decode batches from 2 rows in bf16/fp16, and the LLM path's
# prefill widths) run the int8 matmul kernel below; wider ones (and int4's Triton layout) dequantize
# inside the matmul expression
WIDE_ROWS = 256
# One-row calls: "auto" (int4: the 32-bit-word kernel; int8: the word kernel for weights of at
# least WORDS_MIN values, the per-byte one below that), or "words" / "bytes" everywhere (for
# benchmarks/diag_gemv_variants.py's side-by-side). Read at call time. On the H200 the int8 word
# kernel ran Llama-3-8B's gate/up and head 0.8-2.3 and 10-13 us faster than the byte kernel, q/k/v
# and o 0.3-0.8 us slower, down 0.1 faster to 1.0 slower (two runs, RESULTS.md "One-row GEMVs on
# 32-bit words").
ONE_ROW = "auto"
WORDS_MIN = 64 << 20
KERNELS: dict = {}  # name -> the Triton kernel, once registered (benchmarks read their tuned configs)


@functools.cache
def available() -> bool:
    """Triton and a CUDA device are present (the kernels are CUDA-only)."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def wanted(weight: torch.Tensor) -> bool:
    """Should a layer with this (CUDA) weight use the kernels? Registers the ops if so. Decided
    once, when the layer is built: the forward then only reads tensor shapes, which the
    compiler can trace (a fullgraph compile rejects the import machinery behind available())."""
    if weight.is_cuda and available():
        _register()
        return True
    return False


def usable(x: torch.Tensor, k: int) -> bool:
    """Does a call with input ``x`` (..., k) take a kernel (at trace time, shapes are static)? Widths
    in multiples of 64 keep every weight row 16-byte aligned for the kernels' vector loads."""
    return x.is_cuda and 0 < x.numel() // k <= MAX_ROWS and k % 64 == 0


def float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One row of x (..., K) times a float weight (N, K): the decode step's float GEMV."""
    return torch.ops.torchkiln.float_gemv(x, weight)


def wide(x: torch.Tensor, k: int) -> bool:
    """Does a call with input ``x`` (..., k) take the int8 matmul kernel (prefill widths: more rows
    than the GEMVs serve, at most WIDE_ROWS, in bf16/fp16)?"""
    return (x.is_cuda and MAX_ROWS < x.numel() // k <= WIDE_ROWS and k % 64 == 0
            and x.dtype in (torch.bfloat16, torch.float16))


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.torchkiln.int8_gemv(x, weight, scales)


def int8_fused(x: torch.Tensor, lin: torch.nn.Module, norm: torch.Tensor | None = None, eps: float = 0.0,
               gated: bool = False, resid: torch.Tensor | None = None) -> torch.Tensor:
    """One row of x through an Int8Linear ``lin`` with the decode step's neighbours folded into the
    kernel: ``norm`` (float32, K) and ``eps``: RMS-normalise x and scale it by ``norm`` first;
    ``gated``: ``lin`` holds [gate; up] rows and the result is silu(gate) * up (half the rows);
    ``lin``'s bias and ``resid`` (a residual, N) added to the result. Each of those was a kernel of
    its own in the decode step (see llm/fused.py)."""
    return torch.ops.torchkiln.int8_gemv_fused(x, lin.weight, lin.scales, norm, eps, gated, lin.bias, resid)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group: int) -> torch.Tensor:
    return torch.ops.torchkiln.int4_gemv(x, packed, scale, zero, group)


def tinygemm_dense(packed: torch.Tensor, scale_zero: torch.Tensor, order: torch.Tensor, group: int) -> torch.Tensor:
    """The dense weight [N, K] (scale_zero's dtype) of int4 weights in tinygemm's CUDA layout:
    ``packed`` int32 [N/8, K/128, 32, 4], ``scale_zero`` [K/group, N, 2] and ``order`` (int32 [1024]:
    which of a tile's nibbles holds value row * 128 + column; weight_only._tile_order)."""
    return torch.ops.torchkiln.tinygemm_dense(packed, scale_zero, order, group)


def warm(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Tune each quantized Linear's kernel once (one row), outside any CUDA-graph capture."""
    with torch.no_grad():
        for m in module.modules():
            k = getattr(m, "in_features", None)
            if getattr(m, "kernel", False) and k:
                m(torch.zeros(1, k, device=next(m.buffers()).device, dtype=dtype))


# The one-row int8 kernels' launch shapes (BLOCK_N, BLOCK_K, warps, stages), tuned per weight shape.
ROW_SHAPES = ((8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (16, 512, 8, 4), (32, 256, 4, 3), (32, 256, 8, 4),
              (32, 512, 8, 3), (64, 128, 4, 4), (8, 1024, 8, 3), (16, 1024, 8, 3), (8, 256, 4, 4), (16, 128, 4, 4),
              # 4 rows x 1024: Llama-3-8B's down projection 23.4 -> 19.6 us on the H200
              # (benchmarks/diag_gemv_variants.py)
              (4, 1024, 4, 3), (4, 2048, 4, 3), (8, 2048, 8, 3))


def row_configs(shapes=ROW_SHAPES) -> list:
    import triton

    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


def _pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


@functools.cache
def _register() -> None:
    """Build the Triton kernels and register the ops, once, on first use (no import-time work)."""
    import triton
    import triton.language as tl

    # Integer-to-float conversion units run at a fraction of the FMA rate. Instead, an integer v in
    # [0, 2^23) ORed into the bits of 2^23 is the float 2^23 + v: one integer op and one
    # subtraction. On the H200 the int8 GEMVs of Llama-3-8B's shapes ran 1.06-1.22x faster so
    # (benchmarks/RESULTS.md). Written out in each kernel: a jit helper left in this function's
    # closure is not resolved by Triton (a module global is: _folded_store below).
    configs = row_configs()

    # The one-row kernels' shared end (int8_gemv_fused): the RMS scale of x, silu(gate) * up, bias and
    # residual, then the store. Declared global so the kernels find it among the module's names.
    global _folded_store

    @triton.jit
    def _folded_store(out, up, sq, K, eps, rn, keep, b_ptr, r_ptr, o_ptr, RMS: tl.constexpr, GATED: tl.constexpr):
        if RMS:
            r = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
            out = out * r
            up = up * r
        if GATED:
            out = out / (1.0 + tl.exp(-out)) * up
        if b_ptr is not None:
            out += tl.load(b_ptr + rn, mask=keep, other=0.0).to(tl.float32)
        if r_ptr is not None:
            out += tl.load(r_ptr + rn, mask=keep, other=0.0).to(tl.float32)
        tl.store(o_ptr + rn, out.to(o_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _row(x_ptr, w_ptr, s_ptr, o_ptr, N, K, g_ptr, b_ptr, r_ptr, eps, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, INT8: tl.constexpr, RMS: tl.constexpr, GATED: tl.constexpr):
        # One row of x: a 2-D accumulator, reduced once at the end. On the H200 this form ran
        # Llama-3-8B's shapes 1.25-1.5x faster than the many-row kernel below given one row
        # (two runs of benchmarks/llm_gemv.py, before the bit trick; RESULTS.md). INT8: int8
        # weights with per-row scales (s_ptr); else float weights (s_ptr unused). RMS, GATED,
        # b_ptr, r_ptr: the decode step's neighbours folded in (see int8_gemv_fused).
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        keep = rn < N
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
        x_ptrs = x_ptr + rk
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            inside = rk < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=keep[:, None] & inside[None, :], other=0)
            x = tl.load(x_ptrs, mask=inside, other=0.0).to(tl.float32)
            if RMS:
                sq += x * x
                x = x * tl.load(g_ptr + k * BLOCK_K + rk, mask=inside, other=0.0)
            if INT8:  # int8 + 128 is in [1, 255]: the float of it less 128 is the weight
                wf = ((w.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            else:
                wf = w.to(tl.float32)
            acc += wf * x[None, :]
            if GATED:  # the up row N + n of the same weight, against the same x
                u = tl.load(w_ptrs + N * K, mask=keep[:, None] & inside[None, :], other=0)
                acc_up += (((u.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)
        if INT8:
            out = out * tl.load(s_ptr + rn, mask=keep, other=0.0).to(tl.float32)
        up = out  # read only when GATED
        if GATED:
            up = tl.sum(acc_up, axis=1) * tl.load(s_ptr + N + rn, mask=keep, other=0.0).to(tl.float32)
        _folded_store(out, up, sq, K, eps, rn, keep, b_ptr, r_ptr, o_ptr, RMS, GATED)

    _int8_one = triton.autotune(configs=configs, key=["N", "K", "RMS", "GATED"])(_row)

    # float32 x, 2-4 rows. (bf16/fp16 rows take the matmul kernel below from 2 rows: at 2 and 4 rows on
    # the H200 it ran Llama-3-8B's q/k/v and gate/up 1.25-3.1x faster than this kernel, its down 0.83x
    # at 2 rows and 1.2x at 4; benchmarks/diag_rows.py, RESULTS.md "int4 and int8 at batch > 1".)
    @triton.autotune(configs=configs, key=["N", "K", "ROWS"])
    @triton.jit
    def _int8_few(x_ptr, w_ptr, s_ptr, o_ptr, M, N, K, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
        # All ROWS rows of x in one program: the weight tile is read once for every row.
        rm = tl.arange(0, ROWS)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        keep = rn < N
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
        x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            inside = rk < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=keep[:, None] & inside[None, :], other=0)
            x = tl.load(x_ptrs, mask=(rm[:, None] < M) & inside[None, :], other=0.0).to(tl.float32)
            wf = ((w.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            acc += wf[None, :, :] * x[:, None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=2) * tl.load(s_ptr + rn, mask=keep, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr + rm[:, None] * N + rn[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & keep[None, :])

    configs4 = [triton.Config({"BLOCK_N": n, "R": r}, num_warps=w, num_stages=s)
                for n, r, w, s in ((16, 2, 4, 3), (16, 4, 4, 3), (32, 2, 4, 3), (32, 4, 8, 3),
                                   (8, 8, 4, 3), (64, 2, 8, 3), (16, 8, 8, 4), (32, 1, 4, 4))]

    @triton.autotune(configs=configs4, key=["N", "K", "G", "ROWS"])
    @triton.jit
    def _int4(x_ptr, p_ptr, s_ptr, z_ptr, o_ptr, M, N, K, G: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_N: tl.constexpr, R: tl.constexpr):
        HALF: tl.constexpr = G // 2
        rm = tl.arange(0, ROWS)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, R)
        rj = tl.arange(0, HALF)
        keep = rn < N
        groups = K // G
        p_ptrs = p_ptr + rn[:, None, None].to(tl.int64) * (K // 2) + rr[None, :, None] * HALF + rj[None, None, :]
        x_ptrs = x_ptr + rr[:, None] * G + rj[None, :]
        q_ptrs = rn[:, None].to(tl.int64) * groups + rr[None, :]  # scale and zero offsets
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(groups, R)):
            inside = rr < groups - g * R
            both = keep[:, None] & inside[None, :]
            p = tl.load(p_ptrs, mask=keep[:, None, None] & inside[None, :, None], other=0).to(tl.int32)
            lo = ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            s = tl.load(s_ptr + q_ptrs, mask=both, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + q_ptrs, mask=both, other=0.0).to(tl.float32)
            for m in tl.static_range(ROWS):  # the dequantized tile serves every row
                real = inside[:, None] & ((rj[None, :] * 0 + m) < M)  # a padding row reads zeros
                xl = tl.load(x_ptrs + m * K, mask=real, other=0.0).to(tl.float32)
                xh = tl.load(x_ptrs + m * K + HALF, mask=real, other=0.0).to(tl.float32)
                part = tl.sum(lo * xl[None, :, :] + hi * xh[None, :, :], axis=2)  # per group: sum q x
                xs = tl.sum(xl + xh, axis=1)  # per group: sum x, for the zero point
                got = tl.sum(s * part + z * xs[None, :], axis=1)
                acc = tl.where(rm[:, None] == m, acc + got[None, :], acc)
            p_ptrs += R * HALF
            x_ptrs += R * G
            q_ptrs += R
        tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & keep[None, :])

    # One row, weights read as 32-bit words. Per word, each 8-bit (int8) or 4-bit (int4) field is
    # masked in place and ORed into 2^23's bits: the float 2^23 + field * 2^(position). A field
    # stays in the 23 mantissa bits up to bit 20 (int4) or 16 (int8), so one shift per word brings
    # the rest down; the power of two goes into the matching x instead (exact). That is ~1.1
    # integer operations per int4 value and 1.5 per int8 value, against ~2 and ~3 shifting every
    # field to bit 0 (the byte kernels). Measured on the H200 (RESULTS.md, "One-row GEMVs on 32-bit
    # words"): int4 1.02-1.28x the byte kernel (with the next tile's load issued before the current
    # one is used, and 64-row tiles on the large shapes), int8 mixed (ONE_ROW above); neither
    # reached tinygemm's int4 (gate/up 39.2 us against 33.7), so fewer integer operations were not
    # what bounds these kernels.
    def _fits_words(configs, named_args, **kw):  # whole tiles along K (K % 64 == 0: usable())
        k = named_args["K"]
        return [c for c in configs if (k // 4) % c.kwargs.get("BLOCK_W", 1) == 0
                and (k // named_args.get("G", 1)) % c.kwargs.get("R", 1) == 0]

    configs8w = [triton.Config({"BLOCK_N": n, "BLOCK_W": w}, num_warps=nw, num_stages=st)
                 for n, w, nw, st in ((8, 128, 4, 3), (16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 8, 4),
                                      (32, 64, 4, 3), (32, 64, 8, 4), (32, 128, 8, 3), (4, 256, 4, 3),
                                      (4, 512, 4, 3), (8, 256, 8, 3), (8, 512, 8, 3), (16, 256, 8, 3),
                                      (32, 128, 4, 3), (64, 64, 4, 3), (32, 256, 8, 3), (16, 16, 4, 4))]

    @triton.autotune(configs=configs8w, key=["N", "K", "RMS", "GATED"],
                     prune_configs_by={"early_config_prune": _fits_words})
    @triton.jit
    def _int8_words(x_ptr, w_ptr, s_ptr, o_ptr, N, K, g_ptr, b_ptr, r_ptr, eps, BLOCK_N: tl.constexpr,
                    BLOCK_W: tl.constexpr, RMS: tl.constexpr, GATED: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rw = tl.arange(0, BLOCK_W)
        keep = rn < N
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * (K // 4) + rw[None, :]
        x_ptrs = x_ptr + 4 * rw  # byte t of word j is column 4j + t
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        xsum = tl.zeros((BLOCK_W,), dtype=tl.float32)
        sq = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for i in range(0, K // (4 * BLOCK_W)):
            # each byte's sign bit flipped (0x80808080): the unsigned byte is the weight + 128
            w = tl.load(w_ptrs, mask=keep[:, None], other=0) ^ -0x7F7F7F80
            top = w >> 16
            if GATED:  # the up row N + n of the same weight, against the same x
                u = tl.load(w_ptrs + N * (K // 4), mask=keep[:, None], other=0) ^ -0x7F7F7F80
                u_top = u >> 16
            for t in tl.static_range(4):
                xv = tl.load(x_ptrs + t).to(tl.float32)
                if RMS:
                    sq += xv * xv
                    xv = xv * tl.load(g_ptr + i * 4 * BLOCK_W + 4 * rw + t)
                xsum += xv
                if t % 2 == 1:
                    xv = xv * (1.0 / 256)
                if t < 2:
                    bits = (w & (0xFF << (8 * t))) | 0x4B000000
                else:
                    bits = (top & (0xFF << (8 * (t - 2)))) | 0x4B000000
                acc += (bits.to(tl.float32, bitcast=True) - 8388608.0) * xv[None, :]
                if GATED:
                    if t < 2:
                        bits = (u & (0xFF << (8 * t))) | 0x4B000000
                    else:
                        bits = (u_top & (0xFF << (8 * (t - 2)))) | 0x4B000000
                    acc_up += (bits.to(tl.float32, bitcast=True) - 8388608.0) * xv[None, :]
            w_ptrs += BLOCK_W
            x_ptrs += 4 * BLOCK_W
        offset = 128.0 * tl.sum(xsum, axis=0)
        out = (tl.sum(acc, axis=1) - offset) * tl.load(s_ptr + rn, mask=keep, other=0.0).to(tl.float32)
        up = out  # read only when GATED
        if GATED:
            up = (tl.sum(acc_up, axis=1) - offset) * tl.load(s_ptr + N + rn, mask=keep, other=0.0).to(tl.float32)
        _folded_store(out, up, sq, K, eps, rn, keep, b_ptr, r_ptr, o_ptr, RMS, GATED)

    configs4w = [triton.Config({"BLOCK_N": n, "R": r}, num_warps=nw, num_stages=st)
                 for n, r, nw, st in ((8, 4, 4, 3), (16, 2, 4, 3), (16, 4, 4, 3), (16, 4, 8, 3), (32, 2, 4, 3),
                                      (32, 2, 8, 4), (32, 4, 8, 3), (4, 8, 4, 3), (8, 8, 8, 3), (64, 1, 8, 3),
                                      (32, 4, 4, 3), (64, 2, 4, 3), (64, 2, 8, 3), (32, 8, 8, 3), (16, 8, 4, 3),
                                      (64, 4, 8, 3), (128, 1, 4, 3), (128, 2, 8, 3), (16, 1, 4, 4))]

    @triton.autotune(configs=configs4w, key=["N", "K", "G"], prune_configs_by={"early_config_prune": _fits_words})
    @triton.jit
    def _int4_words(x_ptr, p_ptr, s_ptr, z_ptr, o_ptr, N, K, G: tl.constexpr, BLOCK_N: tl.constexpr,
                    R: tl.constexpr):
        W: tl.constexpr = G // 8  # words per row of a group
        HALF: tl.constexpr = G // 2
        groups = K // G
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, R)
        rw = tl.arange(0, W)
        keep = rn < N
        w_ptrs = p_ptr + rn[:, None, None].to(tl.int64) * (K // 8) + rr[None, :, None] * W + rw[None, None, :]
        x_ptrs = x_ptr + rr[:, None] * G + 4 * rw[None, :]
        q_ptrs = rn[:, None].to(tl.int64) * groups + rr[None, :]  # scale and zero offsets
        acc = tl.zeros((BLOCK_N, R, W), dtype=tl.float32)
        acc_z = tl.zeros((BLOCK_N, R), dtype=tl.float32)
        steps = groups // R
        nxt = tl.load(w_ptrs, mask=keep[:, None, None], other=0)
        for i in range(0, steps):
            w = nxt
            w_ptrs += R * W
            nxt = tl.load(w_ptrs, mask=keep[:, None, None] & (i + 1 < steps), other=0)  # the next tile, in flight
            top = w >> 20
            part = tl.zeros((BLOCK_N, R, W), dtype=tl.float32)
            xsum = tl.zeros((R, W), dtype=tl.float32)
            for f in tl.static_range(8):
                # field f: byte f // 2 of the word, low nibble (column 4j + f // 2) or high (+ G / 2)
                xv = tl.load(x_ptrs + (f // 2) + (f % 2) * HALF).to(tl.float32)
                xsum += xv
                if f < 5:
                    bits = (w & (0xF << (4 * f))) | 0x4B000000
                    xv = xv * (1.0 / (1 << (4 * f)))
                else:
                    bits = (top & (0xF << (4 * (f - 5)))) | 0x4B000000
                    xv = xv * (1.0 / (1 << (4 * (f - 5))))
                part += (bits.to(tl.float32, bitcast=True) - 8388608.0) * xv[None, :, :]
            s = tl.load(s_ptr + q_ptrs, mask=keep[:, None], other=0.0).to(tl.float32)
            z = tl.load(z_ptr + q_ptrs, mask=keep[:, None], other=0.0).to(tl.float32)
            acc += s[:, :, None] * part
            acc_z += z * tl.sum(xsum, axis=1)[None, :]
            x_ptrs += R * G
            q_ptrs += R
        out = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc_z, axis=1)
        tl.store(o_ptr + rn, out.to(o_ptr.dtype.element_ty), mask=keep)

    # int8 weights, 5-256 rows (prefill): tiles of x times the int8 tile converted to x's dtype
    # (exact: |q| <= 127 fits bf16's 8 bits), one tensor-core dot per step, the per-channel scale
    # applied to the float32 sum. Why: the expression (gpt-fast's form) dequantizes every weight
    # into a bf16 copy before cuBLAS, which made Llama-3-8B's int8 prefill 27.5 ms against bf16's
    # 9.5 on the H200 (RESULTS.md, #9's benchmark at 2f25052).
    mm_configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                  for m, n, k, w, st in ((16, 64, 64, 4, 4), (16, 64, 128, 4, 4), (32, 64, 64, 4, 4), (32, 128, 64, 4, 4),
                                         (32, 64, 128, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
                                         (64, 128, 128, 8, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4))]

    def _fits_mm(configs, named_args, **kw):  # whole K steps (K % 64 == 0: the first config always
        # fits); no M tile much taller than the rows
        return [c for c in configs if named_args["K"] % c.kwargs["BLOCK_K"] == 0
                and c.kwargs["BLOCK_M"] <= max(16, named_args["MB"])]

    @triton.autotune(configs=mm_configs, key=["N", "K", "MB"], prune_configs_by={"early_config_prune": _fits_mm})
    @triton.jit
    def _int8_mm(x_ptr, w_ptr, s_ptr, o_ptr, M, N, K, MB, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K // BLOCK_K):
            a = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
            b = tl.load(w_ptrs, mask=rn[:, None] < N, other=0).to(a.dtype)
            acc += tl.dot(a, tl.trans(b))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    KERNELS.update(int8_words=_int8_words, int4_words=_int4_words, int8_bytes=_int8_one, int4_bytes=_int4,
                   int8_mm=_int8_mm)

    # Float weights, one row: the int8 one-row kernel (_row) without the dequantization. Why: for
    # the decode step's output and down projections cuBLASLt runs a split-K GEMV plus a reduce
    # kernel (10.8 + 1.65 and 30.0 + 1.65 us for Llama-3-8B's o and down on the H200, profiled
    # in benchmarks/diag_llm_step.py); whether this kernel beats that is measured per model at
    # build time (llm/model.py, cuda_projections).
    fconfigs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                for n, k, w, st in ((2, 1024, 4, 3), (4, 512, 4, 3), (4, 1024, 4, 3), (8, 256, 4, 3),
                                    (8, 512, 4, 3), (8, 512, 8, 3), (16, 256, 4, 3), (16, 512, 8, 3),
                                    (2, 2048, 8, 3), (4, 256, 4, 4), (8, 128, 4, 4))]

    _float_one = triton.autotune(configs=fconfigs, key=["N", "K", "RMS", "GATED"])(_row)

    def rows_of(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).contiguous()

    @torch.library.custom_op("torchkiln::int8_gemv", mutates_args=())
    def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x2 = rows_of(x)
        n, k = weight.shape
        out = torch.empty(x2.shape[0], n, device=x.device, dtype=x.dtype)
        m = x2.shape[0]
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        if m == 1 and (ONE_ROW == "words" or ONE_ROW == "auto" and n * k >= WORDS_MIN):
            _int8_words[grid](x2, weight.view(torch.int32), scales, out, n, k, None, None, None, 0.0,
                              RMS=False, GATED=False)
        elif m == 1:
            _int8_one[grid](x2, weight, scales, out, n, k, None, None, None, 0.0, INT8=True, RMS=False, GATED=False)
        elif x.dtype != torch.float32 or m > MAX_ROWS:  # (Int8Linear sends float32 only up to MAX_ROWS)
            mb = max(16, _pow2(m))
            _int8_mm[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))](
                x2, weight, scales, out, m, n, k, mb)
        else:
            _int8_few[grid](x2, weight, scales, out, m, n, k, _pow2(m))
        return out.view(*x.shape[:-1], n)

    @int8_gemv.register_fake
    def _(x, weight, scales):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.custom_op("torchkiln::int8_gemv_fused", mutates_args=())
    def int8_gemv_fused(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, norm: torch.Tensor | None,
                        eps: float, gated: bool, bias: torch.Tensor | None,
                        resid: torch.Tensor | None) -> torch.Tensor:
        x2 = rows_of(x)
        rows, k = weight.shape
        n = rows // 2 if gated else rows
        out = torch.empty(1, n, device=x.device, dtype=x.dtype)
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        resid = None if resid is None else rows_of(resid)
        flags = dict(RMS=norm is not None, GATED=gated)
        if ONE_ROW == "words" or ONE_ROW == "auto" and rows * k >= WORDS_MIN:
            _int8_words[grid](x2, weight.view(torch.int32), scales, out, n, k, norm, bias, resid, eps, **flags)
        else:
            _int8_one[grid](x2, weight, scales, out, n, k, norm, bias, resid, eps, INT8=True, **flags)
        return out.view(*x.shape[:-1], n)

    @int8_gemv_fused.register_fake
    def _(x, weight, scales, norm, eps, gated, bias, resid):
        return x.new_empty(*x.shape[:-1], weight.shape[0] // (2 if gated else 1))

    @torch.library.custom_op("torchkiln::float_gemv", mutates_args=())
    def float_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x2 = rows_of(x)
        if x2.shape[0] != 1:
            return torch.nn.functional.linear(x, weight)
        n, k = weight.shape
        out = torch.empty(1, n, device=x.device, dtype=x.dtype)
        _float_one[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x2, weight.contiguous(), x2, out, n, k,
                                                                     None, None, None, 0.0, INT8=False,
                                                                     RMS=False, GATED=False)
        return out.view(*x.shape[:-1], n)

    @float_gemv.register_fake
    def _(x, weight):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.custom_op("torchkiln::int4_gemv", mutates_args=())
    def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  group: int) -> torch.Tensor:
        x2 = rows_of(x)
        n, k = packed.shape[0], 2 * packed.shape[1]
        out = torch.empty(x2.shape[0], n, device=x.device, dtype=x.dtype)
        m = x2.shape[0]
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        if m == 1 and ONE_ROW != "bytes":
            _int4_words[grid](x2, packed.view(torch.int32), scale, zero, out, n, k, group)
        else:
            _int4[grid](x2, packed, scale, zero, out, m, n, k, group, _pow2(m))
        return out.view(*x.shape[:-1], n)

    @int4_gemv.register_fake
    def _(x, packed, scale, zero, group):
        return x.new_empty(*x.shape[:-1], packed.shape[0])

    # tinygemm's int4 tiles to a dense weight, for calls too wide for tinygemm (weight_only.py,
    # TINYGEMM_ROWS). One program per 8 rows x 128 * TK columns: each value's nibble is read from
    # its tile's words through the order table (the tile's 512 bytes stay in L1), scaled like
    # tinygemm, ``(q - 8) * scale + zero``, and written in row-major order. On the H200 it reads and
    # writes ~1.1 TB/s (Llama-3-8B's gate/up: 254 us), no faster than the same gather written as
    # torch ops and compiled, but those ops run eagerly too (tk.quantize's models, eager prefill),
    # where they materialised int32 copies: 512 us for q/k/v against 57 (benchmarks/diag_rows.py).
    @triton.jit
    def _tinygemm_dense(p_ptr, sz_ptr, ord_ptr, o_ptr, N, K, G: tl.constexpr, TK: tl.constexpr):
        r = tl.arange(0, 8)
        c = tl.arange(0, 128 * TK)
        n = tl.program_id(0) * 8 + r
        col = tl.program_id(1) * 128 * TK + c
        slot = tl.load(ord_ptr + r[:, None] * 128 + (c % 128)[None, :])
        tile = tl.program_id(0).to(tl.int64) * (K // 128) + col // 128  # the tile's index in packed
        word = tl.load(p_ptr + tile[None, :] * 128 + slot // 8)
        q = (word >> ((slot % 8) * 4)) & 0xF
        at = ((col // G)[None, :] * N + n[:, None]).to(tl.int64) * 2
        w = (q - 8).to(tl.float32) * tl.load(sz_ptr + at).to(tl.float32) + tl.load(sz_ptr + at + 1).to(tl.float32)
        tl.store(o_ptr + n[:, None].to(tl.int64) * K + col[None, :], w.to(o_ptr.dtype.element_ty))

    @torch.library.custom_op("torchkiln::tinygemm_dense", mutates_args=())
    def tinygemm_dense(packed: torch.Tensor, scale_zero: torch.Tensor, order: torch.Tensor,
                       group: int) -> torch.Tensor:
        n, k = packed.shape[0] * 8, packed.shape[1] * 128
        out = torch.empty(n, k, device=packed.device, dtype=scale_zero.dtype)
        tk = next(t for t in (8, 4, 2, 1) if (k // 128) % t == 0)
        _tinygemm_dense[(n // 8, k // (128 * tk))](packed, scale_zero, order, out, n, k, group, tk, num_warps=4)
        return out

    @tinygemm_dense.register_fake
    def _(packed, scale_zero, order, group):
        return scale_zero.new_empty(packed.shape[0] * 8, packed.shape[1] * 128)
