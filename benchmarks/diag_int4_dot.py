"""int4 decode GEMVs on the tensor cores: candidate Triton kernels against the served word kernel,
tinygemm and bf16 cuBLAS at Llama-3-8B's shapes, each inside one CUDA graph over >= 256 MB of
weight copies (llm_gemv.py's harness). Run on the GPU:

    python benchmarks/diag_int4_dot.py [--rows 1,4]

Why this shape of kernel: the word kernel (quantization/gemv.py) turns each int4 value into a
float and does one FMA per value on the CUDA cores, and stays 1.3-1.5x behind tinygemm, which
dequantizes into tensor-core tiles (RESULTS.md, "One-row GEMVs on 32-bit words"). Here x is one
(padded) 16-row MMA operand, each group's nibbles become bf16 ``128 + q`` with one OR into the
bits of 128.0 (bf16 has 7 mantissa bits, so 128 + q is exact and no int-to-float conversion runs),
and per group the float32 product is scaled once: ``s * (x . (128 + q)) + (zero - 128 s) * sum(x)``.
"swap" puts the weight tile on the left of the product (see _int4_swap); "wide" dequantizes R groups
to a bf16 tile and multiplies once per step, split along K for the shapes with few row tiles. None
came within 1.4x of tinygemm on gate/up (RESULTS.md, "int4 on the tensor cores, in Triton"), so
none is served; the script stays as the record of what was measured. The measured runs also had
"dot" (x on the left, the tile transposed on the right: the slowest, 1.9-4.6x tinygemm) and, in the
first run, the nibbles converted with int-to-float (1.1-1.15x slower than the OR); both were dropped
from the script afterwards, their figures are in RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from llm_gemv import SHAPES, graph_of, interleaved

from torchkiln.quantization import gemv
from torchkiln.quantization.weight_only import Int4Linear


@functools.cache
def kernel():
    import triton
    import triton.language as tl

    shapes = ((16, 1, 1, 4), (16, 2, 1, 4), (16, 2, 2, 4), (16, 4, 2, 4), (16, 8, 2, 3), (32, 1, 2, 4),
              (32, 2, 2, 4), (32, 4, 4, 3), (32, 8, 4, 3), (64, 1, 4, 4), (64, 2, 4, 4), (64, 4, 4, 3),
              (128, 1, 4, 4), (128, 2, 8, 3), (16, 2, 2, 6), (32, 2, 4, 6))
    configs = [triton.Config({"BLOCK_N": n, "R": r}, num_warps=w, num_stages=s) for n, r, w, s in shapes]

    def fits(configs, named_args, **kw):
        groups = named_args["K"] // named_args["G"]
        return [c for c in configs if groups % c.kwargs["R"] == 0]

    # The weight tile as the MMA's left operand (BLOCK_N output rows x a half group) and x^T as the
    # right one (16 columns): on the H200 the left operand of a wgmma may come from registers, so
    # the dequantized tile need not pass through shared memory.
    @triton.autotune(configs=configs, key=["N", "K"], prune_configs_by={"early_config_prune": fits})
    @triton.jit
    def _int4_swap(x_ptr, p_ptr, s_ptr, z_ptr, o_ptr, M, N, K, G: tl.constexpr, BLOCK_N: tl.constexpr,
                   R: tl.constexpr):
        BLOCK_M: tl.constexpr = 16
        HALF: tl.constexpr = G // 2
        groups = K // G
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rh = tl.arange(0, HALF)
        keep_m = rm < M
        keep_n = rn < N
        p_ptrs = p_ptr + rn[:, None].to(tl.int64) * (K // 2) + rh[None, :]
        x_ptrs = x_ptr + rm[None, :] * K + rh[:, None]  # x^T: (HALF, 16)
        q_offs = rn.to(tl.int64) * groups
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in range(0, groups // R):
            for r in tl.static_range(R):
                p = tl.load(p_ptrs + r * HALF, mask=keep_n[:, None], other=0)
                xl = tl.load(x_ptrs + r * G, mask=keep_m[None, :], other=0.0)
                xh = tl.load(x_ptrs + r * G + HALF, mask=keep_m[None, :], other=0.0)
                lo = ((p & 0xF).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)  # 128 + q
                hi = ((p >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
                d = tl.dot(lo, xl)
                d = tl.dot(hi, xh, d)
                xs = tl.sum(xl.to(tl.float32), axis=0) + tl.sum(xh.to(tl.float32), axis=0)
                s = tl.load(s_ptr + q_offs + i * R + r, mask=keep_n, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + q_offs + i * R + r, mask=keep_n, other=0.0).to(tl.float32)
                acc += d * s[:, None] + (z - 128.0 * s)[:, None] * xs[None, :]
            p_ptrs += R * HALF
            x_ptrs += R * G
        tl.store(o_ptr + rm[None, :] * N + rn[:, None], acc.to(o_ptr.dtype.element_ty),
                 mask=keep_m[None, :] & keep_n[:, None])

    # As _int4_swap, but each tile of R groups is dequantized to bf16 (``q * s + zero``, one rounding,
    # as tinygemm does) and multiplied in one product of R * G / 2 inputs per half, instead of a
    # float32 epilogue per group; SPLIT programs share each row tile's groups (fp32 atomics), for
    # the shapes with few row tiles (o, down).
    sconfigs = [triton.Config({"BLOCK_N": n, "R": r, "SPLIT": sp}, num_warps=w, num_stages=st)
                for n, r, sp, w, st in ((64, 2, 1, 4, 4), (64, 4, 1, 4, 3), (64, 8, 1, 4, 3), (128, 2, 1, 4, 4),
                                        (128, 4, 1, 8, 3), (64, 2, 2, 4, 4), (64, 4, 2, 4, 3), (64, 4, 4, 4, 3),
                                        (64, 2, 4, 4, 4), (128, 2, 2, 4, 4), (128, 4, 4, 8, 3), (64, 8, 4, 4, 3),
                                        (32, 4, 1, 4, 3), (32, 4, 4, 4, 3), (64, 1, 1, 4, 5))]

    def sfits(configs, named_args, **kw):
        groups = named_args["K"] // named_args["G"]
        return [c for c in configs if groups % (c.kwargs["R"] * c.kwargs["SPLIT"]) == 0]

    @triton.autotune(configs=sconfigs, key=["N", "K"], prune_configs_by={"early_config_prune": sfits},
                     reset_to_zero=["o_ptr"])
    @triton.jit
    def _int4_wide(x_ptr, p_ptr, s_ptr, z_ptr, o_ptr, M, N, K, G: tl.constexpr, BLOCK_N: tl.constexpr,
                   R: tl.constexpr, SPLIT: tl.constexpr):
        BLOCK_M: tl.constexpr = 16
        HALF: tl.constexpr = G // 2
        C: tl.constexpr = R * HALF  # bytes of a row per step
        groups = K // G
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rc = tl.arange(0, C)
        keep_m = rm < M
        keep_n = rn < N
        first = tl.program_id(1) * (groups // SPLIT)  # this program's first group
        p_ptrs = p_ptr + rn[:, None].to(tl.int64) * (K // 2) + first * HALF + rc[None, :]
        # column c of a step is byte c: group c // HALF, input (c // HALF) * G + c % HALF (low nibble)
        x_ptrs = x_ptr + rm[None, :] * K + first * G + ((rc // HALF) * G + rc % HALF)[:, None]
        q_ptrs = s_ptr + rn[:, None].to(tl.int64) * groups + first + tl.arange(0, R)[None, :]
        z_ptrs = z_ptr + rn[:, None].to(tl.int64) * groups + first + tl.arange(0, R)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(0, groups // (R * SPLIT)):
            p = tl.load(p_ptrs, mask=keep_n[:, None], other=0)
            s = tl.load(q_ptrs, mask=keep_n[:, None], other=0.0).to(tl.float32)
            z = tl.load(z_ptrs, mask=keep_n[:, None], other=0.0).to(tl.float32)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, R, HALF)), (BLOCK_N, C))
            z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, R, HALF)), (BLOCK_N, C))
            lo = ((p & 0xF).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True).to(tl.float32)
            hi = ((p >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True).to(tl.float32)
            zz = z - 128.0 * s
            xl = tl.load(x_ptrs, mask=keep_m[None, :], other=0.0)
            xh = tl.load(x_ptrs + HALF, mask=keep_m[None, :], other=0.0)
            acc = tl.dot((lo * s + zz).to(tl.bfloat16), xl, acc)
            acc = tl.dot((hi * s + zz).to(tl.bfloat16), xh, acc)
            p_ptrs += C
            x_ptrs += R * G
            q_ptrs += R
            z_ptrs += R
        if SPLIT == 1:
            tl.store(o_ptr + rm[None, :] * N + rn[:, None], acc, mask=keep_m[None, :] & keep_n[:, None])
        else:
            tl.atomic_add(o_ptr + rm[None, :] * N + rn[:, None], acc, mask=keep_m[None, :] & keep_n[:, None])

    def call(x, packed, scale, zero):
        m, k = x.shape
        n = packed.shape[0]
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        _int4_swap[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, packed, scale, zero, out, m, n, k, 128)
        return out

    def wide(x, packed, scale, zero):
        m, k = x.shape
        n = packed.shape[0]
        out = torch.zeros(m, n, device=x.device, dtype=torch.float32)
        _int4_wide[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](
            x, packed, scale, zero, out, m, n, k, 128)
        return out.to(x.dtype)

    return {"swap": _int4_swap, "wide": _int4_wide}, call, wide


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    kern, swap, wide = kernel()
    print("| shape | rows | peer | us/call | x bf16 | x tinygemm | weight GB/s | tuned config |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, (n, k) in SHAPES.items():
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            q4 = Int4Linear(lin, 128)
            count = max(2, -(-(256 << 20) // (n * k)))
            p4 = [q4.packed.clone() for _ in range(count)]
            tg = [Int4Linear(lin, 128, tinygemm=True) for _ in range(count)]
            b4 = n * k // 2 + 4 * n * (k // 128)
            peers = {
                "bf16 F.linear": (F.linear, [(x, lin.weight.detach().clone()) for _ in range(count)], 2 * n * k),
                "int4 served Triton": (lambda x, p, s, z: gemv.int4_linear(x, p, s, z, 128),
                                       [(x, p, q4.scale, q4.zero) for p in p4], b4),
                "int4 tinygemm": (lambda x, m: m(x), [(x, m) for m in tg], b4),
                "int4 swap, OR": (swap, [(x, p, q4.scale, q4.zero) for p in p4], b4),
                "int4 wide, bf16 tile": (wide, [(x, p, q4.scale, q4.zero) for p in p4], b4),
            }
            # the reference, computed another way: the weights dequantized in float32
            grp = q4.packed.view(n, k // 128, 64)
            q = torch.cat((grp & 0xF, grp >> 4), dim=-1).float()
            w4f = (q * q4.scale.float()[..., None] + q4.zero.float()[..., None]).view(n, k)
            graphs, cfgs = {}, {}
            for p, (fn, a, _) in peers.items():
                got = fn(*a[0]).float()
                k_ = kern.get(p.split()[1].rstrip(",")) if p.startswith("int4 ") else None
                cfgs[p] = getattr(k_, "best_config", "") if k_ is not None else ""
                want = x.float() @ (lin.weight.float() if p.startswith("bf16") else w4f).T
                err = float((got - want).norm() / want.norm())
                if err > 1e-2:
                    print(f"  {name} rows {rows} {p}: relative error {err:.4f} against its reference; skipped")
                    continue
                graphs[p] = graph_of(fn, a)
            times = interleaved(graphs, args.rounds, count)
            base = times["bf16 F.linear"]
            tiny = times.get("int4 tinygemm", float("nan"))
            for p, s in times.items():
                cfg = cfgs[p]
                print(f"| {name} {n}x{k} | {rows} | {p} | {s * 1e6:.1f} | {base / s:.2f} | {tiny / s:.2f} | "
                      f"{peers[p][2] / s / 1e9:.0f} | {cfg} |", flush=True)
            del peers, graphs, p4, tg
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
