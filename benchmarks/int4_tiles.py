"""A candidate int4 kernel for 5-40 rows (batched decode) that reads tinygemm's CUDA layout as it is, so
Int4Linear could serve those rows without a second copy of its weights. Not served: `benchmarks/diag_rows.py`
times it on the GPU as the peer "int4 Triton on tinygemm's tiles", and on the H200 it read the weights at
0.4-0.5 TB/s whatever the rows (gate_up 111-115 us at 4-16 rows against tinygemm's 48 / 80 / 135 and
bf16's 58; RESULTS.md, twenty-fourth session), so it beat tinygemm only at 16 rows and never bf16.

Why: tinygemm makes about one pass over the weight per 8-16 rows (Llama-3-8B on the H200 at batch
16 decoded at 9.49 ms per step against bf16's 5.17), and the dense form Int4Linear takes above 40 rows
is slower still at 16 (RESULTS.md, "int4 and int8 at batch > 1"). A Triton kernel on Triton's int4
layout with this structure ("wide" in diag_int4_dot.py) ran 16 rows at about bf16's speed.

How it reads tinygemm's tiles without a gather: in an 8 x 128 tile (inner K tiles 8) the 16 words
of weight row r are contiguous (words 16 r .. 16 r + 15), and nibble b of word w holds the column
``(w % 4) * 32 + (b % 4) * 8 + (w // 4) * 2 + b // 4`` whatever the row (the m16n8k16 B-fragment
order; on the H200 it equalled weight_only._tile_order, read off torch's packing). So each row's
words unpack in place to 128 "virtual" columns, and x is gathered in that same order instead.
Each step dequantizes one k-tile like tinygemm (``(q - 8) * scale + zero``, rounded to x's dtype)
and multiplies it with the 16-row (padded) x on the tensor cores.

Check it on the CPU with Triton's interpreter (fp16: the interpreter's bf16 dot is wrong):

    TRITON_INTERPRET=1 python benchmarks/int4_tiles.py
"""

from __future__ import annotations

import functools

import torch


def columns() -> torch.Tensor:
    """The real column (0-127) of each virtual column v = 8 * word + nibble of a row's 16 words."""
    v = torch.arange(128)
    w, b = v // 8, v % 8
    return (w % 4) * 32 + (b % 4) * 8 + (w // 4) * 2 + b // 4


def pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0-15) in tinygemm's CUDA layout, int32 [N/8, K/128, 32, 4], written from the
    closed form above (the GPU packs with torch's own op; this is for the CPU check)."""
    n, k = q.shape
    cols = columns()
    tiles = q.view(n // 8, 8, k // 128, 128).permute(0, 2, 1, 3)  # [N/8, K/128, 8 rows, 128]
    nib = tiles[..., cols].reshape(n // 8, k // 128, 8, 16, 8).int()
    words = torch.zeros(n // 8, k // 128, 8, 16, dtype=torch.int64)
    for b in range(8):
        words |= nib[..., b].long() << (4 * b)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the int32 bit pattern
    return words.to(torch.int32).reshape(n // 8, k // 128, 32, 4)


@functools.cache
def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _int4_tiles(x_ptr, p_ptr, sz_ptr, o_ptr, M, N, K, G: tl.constexpr, TILES_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr):
        # TILES_K (K / 128) is a compile-time constant: the loop bound (Triton's interpreter also
        # cannot loop over a bound computed from a runtime scalar)
        BLOCK_M: tl.constexpr = 16
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep_m = rm < M
        keep_n = rn < N
        v = tl.arange(0, 128)
        col = ((v // 8) % 4) * 32 + (v % 4) * 8 + (v // 32) * 2 + (v % 8) // 4
        steps: tl.constexpr = TILES_K // SPLIT
        first = tl.program_id(1) * steps
        row_words = (rn // 8).to(tl.int64) * TILES_K * 128 + (rn % 8) * 16  # word 0 of each row's k-tile 0
        shift = tl.arange(0, 8) * 4
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in range(0, steps // R):
            for r in tl.static_range(R):
                kt = first + i * R + r
                words = tl.load(p_ptr + row_words[:, None] + kt * 128 + tl.arange(0, 16)[None, :],
                                mask=keep_n[:, None], other=0)
                q = tl.reshape((words[:, :, None] >> shift[None, None, :]) & 0xF, (BLOCK_N, 128))
                c = kt * 128 + col
                if G % 128 == 0:  # one group per row of the tile: a scale and zero per row, not per code
                    at = ((kt * 128 // G) * N + rn).to(tl.int64) * 2
                    s = tl.load(sz_ptr + at, mask=keep_n, other=0.0).to(tl.float32)[:, None]
                    z = tl.load(sz_ptr + at + 1, mask=keep_n, other=0.0).to(tl.float32)[:, None]
                else:
                    at = ((c // G)[None, :] * N + rn[:, None]).to(tl.int64) * 2
                    s = tl.load(sz_ptr + at, mask=keep_n[:, None], other=0.0).to(tl.float32)
                    z = tl.load(sz_ptr + at + 1, mask=keep_n[:, None], other=0.0).to(tl.float32)
                xt = tl.load(x_ptr + rm[None, :] * K + c[:, None], mask=keep_m[None, :], other=0.0)  # x^T
                acc = tl.dot(((q - 8).to(tl.float32) * s + z).to(xt.dtype), xt, acc)
        ptrs = o_ptr + rm[None, :] * N + rn[:, None]
        if SPLIT == 1:
            tl.store(ptrs, acc, mask=keep_m[None, :] & keep_n[:, None])
        else:
            tl.atomic_add(ptrs, acc, mask=keep_m[None, :] & keep_n[:, None])

    configs = [triton.Config({"BLOCK_N": n, "R": r, "SPLIT": sp}, num_warps=w, num_stages=st)
               for n, r, sp, w, st in ((64, 1, 1, 4, 4), (64, 2, 1, 4, 3), (128, 1, 1, 4, 4), (128, 2, 1, 8, 3),
                                       (64, 1, 2, 4, 4), (64, 1, 4, 4, 4), (64, 2, 4, 4, 3), (128, 1, 4, 8, 4),
                                       (32, 1, 4, 4, 4), (32, 2, 1, 4, 4), (16, 1, 4, 4, 4), (128, 4, 1, 8, 3),
                                       (256, 2, 1, 8, 3), (64, 4, 2, 4, 3))]

    def fits(configs, named_args, **kw):
        tiles_k = named_args["K"] // 128
        return [c for c in configs if tiles_k % (c.kwargs["R"] * c.kwargs["SPLIT"]) == 0]

    tuned = triton.autotune(configs=configs, key=["N", "K", "G", "TILES_K"], prune_configs_by={"early_config_prune": fits},
                            reset_to_zero=["o_ptr"])(_int4_tiles)

    def call(x, packed, scale_zero, group, **fixed):
        """x [M <= 16, K] times the int4 weight in tinygemm's layout; ``fixed``: BLOCK_N, R, SPLIT (no
        autotuning, for the interpreter)."""
        m, k = x.shape
        n = packed.shape[0] * 8
        out = torch.zeros(m, n, device=x.device, dtype=torch.float32)
        fn = _int4_tiles if fixed else tuned
        fn[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](x, packed, scale_zero, out, m, n, k, group,
                                                                         k // 128, **fixed)
        return out.to(x.dtype)

    return call


def main() -> int:
    """Against a float64 product over the dequantized weight, for a few shapes, groups and splits."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    call = kernel()
    worst = 0.0
    for n, k, rows, group, fixed in ((48, 384, 3, 128, dict(BLOCK_N=16, R=1, SPLIT=1)),
                                     (64, 512, 16, 32, dict(BLOCK_N=32, R=2, SPLIT=2)),
                                     (40, 256, 1, 64, dict(BLOCK_N=16, R=1, SPLIT=2))):
        g = torch.Generator().manual_seed(n + k)
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(k // group, n, generator=g) * 0.01 + 1e-3
        zero = torch.randn(k // group, n, generator=g) * 0.01
        sz = torch.stack((scale, zero), dim=-1).half()
        w = (q.double() - 8).view(n, k // group, group) * sz[..., 0].t().double()[..., None] \
            + sz[..., 1].t().double()[..., None]
        x = torch.randn(rows, k, generator=g).half()
        ref = x.double() @ w.view(n, k).t()
        packed = pack(q)
        if dev.type == "cuda":  # the layout the GPU packs, against the closed form
            pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(dev)
            assert torch.equal(torch.ops.aten._convert_weight_to_int4pack(pairs, 8).cpu(), packed)
        got = call(x.to(dev), packed.to(dev), sz.to(dev), group, **fixed).double().cpu()
        err = float((got - ref).norm() / ref.norm())
        worst = max(worst, err)
        print(f"N {n} K {k} rows {rows} group {group} {fixed}: relative error {err:.2e}")
    print("ok" if worst < 5e-3 else "FAILED")
    return 0 if worst < 5e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
