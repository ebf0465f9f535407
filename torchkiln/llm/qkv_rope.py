"""RoPE and the KV-cache writes of a one-row CUDA decode step, in one kernel instead of inductor's three.

After the q/k/v projection the compiled step ran three more kernels per layer on the H200: the
rotary embedding of q and k and the two cache writes (index_copy_), ~1.8 + 1.2 + 1.0 us for a few
KB each (Llama-3-8B int8, benchmarks/diag_llm_step.py; RESULTS.md, twenty-first session). Both
kernels here work on rotary *pairs* (row j and row j + D/2 of a head: the half-split rotation
transformers uses pairs them), so the rotation is elementwise in registers; q is stored rotated,
k and v go straight into the cache at the step's slot. Value heads are "rotated" by cos 1, sin 0
(exact), so one program shape serves every head.
- ``qkv_rope``: the folded int8 step's q/k/v GEMV (llm/fused.py) with all of that in its epilogue.
  The product, norm, bias and rotation stay in float32 and are rounded once, where the unfused
  step rounds q/k/v to the model's dtype before rotating: outputs differ by rounding.
- ``rope_cache``: after a projection that stays outside (float, int4): rotates its rounded output
  in float32 and rounds once, as the compiled expression does.

Serves one row (batch 1, one token), heads in [q | k | v] order with full-width rotary and no
per-head norm (``fits``); anything else keeps inductor's form. Tested: tests/llm/test_fused.py.
"""

from __future__ import annotations

import functools

import torch

from ..quantization import gemv

ROPE = True  # CUDA one-row steps rotate and write the cache here (False: side-by-sides, diag_llm_step)


def qkv_rope(x: torch.Tensor, lin: torch.nn.Module, norm: torch.Tensor | None, eps: float, cos: torch.Tensor,
             sin: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             heads: int) -> torch.Tensor:
    """One row x (1, 1, K) through the int8 q/k/v Linear ``lin`` (RMS-normalised by ``norm`` first,
    as gemv.int8_fused), rotated by row ``pos`` (a one-element tensor) of the ``cos``/``sin`` tables
    (positions, head_dim); k and v written into ``k_cache``/``v_cache`` (1, KV, S, D) at ``slot`` (a
    (1,) tensor). Returns q (1, heads, 1, D), rotated. register() first (outside any compiled region)."""
    return torch.ops.torchkiln.int8_qkv_rope(x, lin.weight, lin.scales, norm, eps, lin.bias, cos, sin, pos, slot,
                                             k_cache, v_cache, heads)


def fits(spec) -> bool:
    """Can these kernels serve a decoder of this DecoderSpec: [q | k | v] rows, rotary over the whole
    head (transformers' half-split form, FastDecoder's tables), no per-head norm between the
    projection and the rotation, one table (not longrope's two, chosen per forward)?"""
    return (spec.qkv_layout != "headwise" and spec.positions == "rotary" and spec.rotary_dim == spec.head_dim
            and not spec.qk_norm and spec.head_dim % 2 == 0 and spec.long_after is None
            and spec.rope_pairs == "halves")


def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
    """The rotation and cache write after a q/k/v projection that stays outside (float and int4 steps;
    inductor's three kernels took 1.2 + 1.8 + 1.0 us a layer in Llama-3-8B's bf16 step on the H200).
    qkv (1, 1, (heads + 2 KV) * D). Returns q (1, heads, 1, D), rotated. register() first."""
    return torch.ops.torchkiln.rope_cache(qkv, cos, sin, pos, slot, k_cache, v_cache, heads)


@functools.cache
def register() -> None:
    """Build the kernels and register the ops, once, on first use (no import-time work)."""
    import triton
    import triton.language as tl

    # Both kernels' end: rotate the pairs (a, b) of q and k heads, store q, write k and v into the
    # cache at the slot. A module global, so the kernels find it (Triton does not resolve a jit
    # helper from this function's closure).
    global _rotate_store

    @triton.jit
    def _rotate_store(a, b, j, head, keep, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, H, KV, S,
                      D: tl.constexpr):
        HALF: tl.constexpr = D // 2
        row = head * D + j
        # transformers' rotation: [a, b] -> [a cos - b sin, b cos + a sin] (cos/sin of j and j + HALF)
        turn = keep & (head < H + KV)
        at = tl.load(pos_ptr) * D + j  # this position's row of the tables
        cos_ptr += at
        sin_ptr += at
        c1 = tl.load(cos_ptr, mask=turn, other=1.0).to(tl.float32)
        c2 = tl.load(cos_ptr + HALF, mask=turn, other=1.0).to(tl.float32)
        s1 = tl.load(sin_ptr, mask=turn, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + HALF, mask=turn, other=0.0).to(tl.float32)
        ra = a * c1 - b * s1
        rb = b * c2 + a * s2
        is_q = keep & (head < H)
        tl.store(q_ptr + row, ra.to(q_ptr.dtype.element_ty), mask=is_q)
        tl.store(q_ptr + row + HALF, rb.to(q_ptr.dtype.element_ty), mask=is_q)
        slot = tl.load(slot_ptr)
        is_k = keep & (head >= H) & (head < H + KV)
        at = (head - H).to(tl.int64) * S * D + slot * D + j  # cache (1, KV, S, D)
        tl.store(kc_ptr + at, ra.to(kc_ptr.dtype.element_ty), mask=is_k)
        tl.store(kc_ptr + at + HALF, rb.to(kc_ptr.dtype.element_ty), mask=is_k)
        is_v = keep & (head >= H + KV)
        at = at - KV * S * D
        tl.store(vc_ptr + at, ra.to(vc_ptr.dtype.element_ty), mask=is_v)
        tl.store(vc_ptr + at + HALF, rb.to(vc_ptr.dtype.element_ty), mask=is_v)

    # BLOCK_N counts pairs, two rows each: gemv's one-row shapes, and each with half the pairs (the
    # same rows per program as the plain kernel's tuned tile)
    halved = {(max(2, n // 2), *rest) for n, *rest in gemv.ROW_SHAPES}

    @triton.autotune(configs=gemv.row_configs(sorted(set(gemv.ROW_SHAPES) | halved)), key=["P", "K", "RMS"])
    @triton.jit
    def _int8_qkv_rope(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr,
                       P, K, H, KV, S, eps, D: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        HALF: tl.constexpr = D // 2
        p = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rotary pairs, over all heads
        keep = p < P
        head = p // HALF
        j = p % HALF
        row = head * D + j  # the pair's first row; its partner is row + HALF
        rk = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + row[:, None].to(tl.int64) * K + rk[None, :]
        x_ptrs = x_ptr + rk
        acc_a = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            inside = rk < K - k * BLOCK_K
            both = keep[:, None] & inside[None, :]
            wa = tl.load(w_ptrs, mask=both, other=0)
            wb = tl.load(w_ptrs + HALF * K, mask=both, other=0)
            x = tl.load(x_ptrs, mask=inside, other=0.0).to(tl.float32)
            if RMS:
                sq += x * x
                x = x * tl.load(g_ptr + k * BLOCK_K + rk, mask=inside, other=0.0)
            # int8 to float by the bit trick of gemv's kernels (int8 + 128 ORed into 2^23's bits)
            acc_a += (((wa.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x[None, :]
            acc_b += (((wb.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        a = tl.sum(acc_a, axis=1) * tl.load(s_ptr + row, mask=keep, other=0.0).to(tl.float32)
        b = tl.sum(acc_b, axis=1) * tl.load(s_ptr + row + HALF, mask=keep, other=0.0).to(tl.float32)
        if RMS:
            r = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
            a = a * r
            b = b * r
        if b_ptr is not None:
            a += tl.load(b_ptr + row, mask=keep, other=0.0).to(tl.float32)
            b += tl.load(b_ptr + row + HALF, mask=keep, other=0.0).to(tl.float32)
        _rotate_store(a, b, j, head, keep, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, H, KV, S, D)

    @triton.jit
    def _rope_cache(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, P, H, KV, S,
                    D: tl.constexpr, BLOCK: tl.constexpr):
        HALF: tl.constexpr = D // 2
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = p < P
        head = p // HALF
        j = p % HALF
        row = head * D + j  # the pair's first row; its partner is row + HALF
        a = tl.load(qkv_ptr + row, mask=keep, other=0.0).to(tl.float32)
        b = tl.load(qkv_ptr + row + HALF, mask=keep, other=0.0).to(tl.float32)
        _rotate_store(a, b, j, head, keep, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, H, KV, S, D)

    gemv.KERNELS.update(int8_qkv_rope=_int8_qkv_rope, rope_cache=_rope_cache)

    @torch.library.custom_op("torchkiln::int8_qkv_rope", mutates_args=("k_cache", "v_cache"))
    def int8_qkv_rope(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, norm: torch.Tensor | None,
                      eps: float, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                      slot: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
        _, kv, s, d = k_cache.shape
        rows, k = weight.shape
        q = torch.empty(1, heads, 1, d, device=x.device, dtype=x.dtype)
        pairs = rows // 2
        _int8_qkv_rope[lambda meta: (triton.cdiv(pairs, meta["BLOCK_N"]),)](
            x.reshape(1, k).contiguous(), weight, scales, norm, bias, cos.contiguous(), sin.contiguous(), pos, slot,
            q, k_cache, v_cache, pairs, k, heads, kv, s, eps, D=d, RMS=norm is not None)
        return q

    @int8_qkv_rope.register_fake
    def _(x, weight, scales, norm, eps, bias, cos, sin, pos, slot, k_cache, v_cache, heads):
        return x.new_empty(1, heads, 1, k_cache.shape[-1])

    @torch.library.custom_op("torchkiln::rope_cache", mutates_args=("k_cache", "v_cache"))
    def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
        _, kv, s, d = k_cache.shape
        q = torch.empty(1, heads, 1, d, device=qkv.device, dtype=qkv.dtype)
        pairs = qkv.shape[-1] // 2
        # 128 pairs a program (24 programs for Llama-3-8B): 1024 (3 programs) took 2.24 us on the H200
        _rope_cache[(triton.cdiv(pairs, 128),)](qkv.contiguous(), cos.contiguous(), sin.contiguous(), pos, slot, q,
                                                k_cache, v_cache, pairs, heads, kv, s, D=d, BLOCK=128, num_warps=4)
        return q

    @rope_cache.register_fake
    def _(qkv, cos, sin, pos, slot, k_cache, v_cache, heads):
        return qkv.new_empty(1, heads, 1, k_cache.shape[-1])
