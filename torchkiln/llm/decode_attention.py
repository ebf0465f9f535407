"""One-query attention over the KV cache for the CUDA decode step, hand-written in Triton.

Why hand-written: in the H200 profile of Llama-3-8B's bf16 decode step, torch's SDPA with the
cache mask and grouped KV heads ran cuDNN's flash kernel (8.1 us a layer, for a 256-slot cache
of 1 MB) plus a kernel that turns the boolean mask into a bias (1.2 us); flash attention takes no
mask, and the one-query shape leaves cuDNN's tiles mostly empty. The math form compiled by
inductor was slower still (float copies of the cache) (benchmarks/diag_llm_step.py).

Flash-decoding's form: the cache is cut into ``splits`` chunks along its length; one program per
(row, query head, chunk) streams its chunk with an online softmax and writes a partial (max, sum,
weighted values); a second kernel merges the chunks per (row, head). The mask is the decode
step's own boolean (B, 1, 1, S): True = attend. Every row attends at least its own slot
(FastDecoder's mask), so no merged row is empty. Registered as a custom op (``torchkiln::``):
torch.compile and CUDA graphs see one opaque call.

Launch shape and where it serves, from benchmarks/diag_decode_attention.py (H200, Llama-3-8B's
heads, 32 calls in one CUDA graph; RESULTS.md): 32-slot tiles, one warp per program, up to 16
chunks: 4.6 us a call at 256 slots (SDPA 11.8), 9.4 at 1024 (SDPA 12.7), but 25.6 at 4096 where
SDPA took 17.4: longer caches stay with SDPA (MAX_SLOTS).
"""

from __future__ import annotations

import functools

import torch

from ..quantization.gemv import available

BLOCK_S = 32  # cache slots per load: a (32 x head_dim) tile of K and of V per step
MAX_SPLITS = 16  # chunks per (row, head); a power of two (the merge's arange)
NUM_WARPS = 1  # one warp per program: 1.3x faster than 4 at 256 slots (the diag above)
MAX_SLOTS = 1024  # longer caches: SDPA


def wanted(device: torch.device) -> bool:
    """Should decode steps on ``device`` attend through the kernel? Registers the op if so."""
    if device.type == "cuda" and available():
        _register()
        return True
    return False


def usable(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """One query per row (decode) on CUDA, over a cache no longer than MAX_SLOTS (shapes are
    static at trace time, so this picks per compiled cache length)."""
    return q.is_cuda and q.shape[2] == 1 and cache.shape[2] <= MAX_SLOTS


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, 1, D); k, v (B, KV, S, D); mask (B or 1, 1, 1, S) bool. Returns (B, H, 1, D)."""
    return torch.ops.torchkiln.decode_attention(q, k, v, mask, scale)


def splits_for(slots: int) -> int:
    """Chunks for a cache of ``slots``: a power of two (the merge's arange) of at most MAX_SPLITS;
    chunks past the cache's end are empty and weigh nothing in the merge."""
    blocks = -(-slots // BLOCK_S)
    return min(1 << (blocks - 1).bit_length(), MAX_SPLITS)


@functools.cache
def _register() -> None:
    """Build the kernels and register the op, once, on first use (no import-time work)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _partial(q_ptr, k_ptr, v_ptr, m_ptr, ml_ptr, acc_ptr, o_ptr, scale, H, G, S, D, CHUNK,
                 sq_b, sq_h, sk_b, sk_h, sk_s, sm_b, SPLITS: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H
        h = bh % H
        kvh = h // G
        rd = tl.arange(0, BLOCK_D)
        rs = tl.arange(0, BLOCK)
        in_d = rd < D
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rd, mask=in_d, other=0.0).to(tl.float32) * scale
        base = b.to(tl.int64) * sk_b + kvh * sk_h
        start = split * CHUNK
        m_i = tl.zeros((), dtype=tl.float32) - float("inf")
        l_i = tl.zeros((), dtype=tl.float32)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for s0 in range(0, CHUNK, BLOCK):  # slots past the cache's end load nothing
            slots = start + s0 + rs
            live = slots < S
            ok = tl.load(m_ptr + b * sm_b + slots, mask=live, other=0) != 0
            tile = base + slots[:, None] * sk_s + rd[None, :]
            both = live[:, None] & in_d[None, :]
            k = tl.load(k_ptr + tile, mask=both, other=0.0).to(tl.float32)
            scores = tl.where(ok, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all-masked tile so far
            p = tl.exp(scores - m_safe)
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_ptr + tile, mask=both, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        if SPLITS == 1:  # the whole cache in one program: the output itself, no merge
            tl.store(o_ptr + bh * D + rd, (acc / l_i).to(o_ptr.dtype.element_ty), mask=in_d)
        else:
            out = bh * SPLITS + split
            tl.store(ml_ptr + out * 2, m_i)
            tl.store(ml_ptr + out * 2 + 1, l_i)
            tl.store(acc_ptr + out * BLOCK_D + rd, acc)

    @triton.jit
    def _merge(ml_ptr, acc_ptr, o_ptr, D, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
        bh = tl.program_id(0)
        rp = tl.arange(0, SPLITS)
        rd = tl.arange(0, BLOCK_D)
        m = tl.load(ml_ptr + (bh * SPLITS + rp) * 2)
        lsum = tl.load(ml_ptr + (bh * SPLITS + rp) * 2 + 1)
        top = tl.max(m, axis=0)  # finite: the row's own slot is always attended
        w = tl.exp(m - top)  # an empty chunk (max -inf) weighs 0
        acc = tl.load(acc_ptr + (bh * SPLITS + rp)[:, None] * BLOCK_D + rd[None, :])
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
        tl.store(o_ptr + bh * D + rd, out.to(o_ptr.dtype.element_ty), mask=rd < D)

    @torch.library.custom_op("torchkiln::decode_attention", mutates_args=())
    def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
        B, H, _, D = q.shape
        KV, S = k.shape[1], k.shape[2]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        m = mask.reshape(mask.shape[0], S).contiguous().view(torch.uint8)
        splits = splits_for(S)
        chunk = -(-S // splits)
        chunk = -(-chunk // BLOCK_S) * BLOCK_S
        block_d = triton.next_power_of_2(D)
        out = torch.empty_like(q)
        ml = torch.empty(B * H, splits, 2, device=q.device, dtype=torch.float32)
        acc = torch.empty(B * H, splits, block_d, device=q.device, dtype=torch.float32)
        _partial[(B * H, splits)](q, k, v, m, ml, acc, out, scale, H, H // KV, S, D, chunk,
                                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                                   m.stride(0) if m.shape[0] > 1 else 0, splits, BLOCK_S, block_d,
                                   num_warps=NUM_WARPS)
        if splits > 1:
            _merge[(B * H,)](ml, acc, out, D, splits, block_d, num_warps=1 if block_d <= 128 else 2)
        return out

    @decode_attention.register_fake
    def _(q, k, v, mask, scale):
        return torch.empty_like(q)
