"""Candidate decode GEMV kernels against the ones tk.llm serves (quantization/gemv.py), one row, Llama-3-8B's
shapes, each inside one CUDA graph over >= 256 MB of weight copies (llm_gemv.py's harness).

    python benchmarks/diag_gemv_variants.py

Candidates:
- int8 split-K: the one-row int8 kernel with K cut into SPLIT slices whose partial sums are added
  atomically into a float32 output (more programs in flight for the narrow shapes);
- int4 v2: the int4 GEMV with an elementwise 3-D accumulator reduced once at the end (the form that
  made the int8 kernel faster), optionally split along K the same way;
- bf16 Triton: the one-row kernel reading bf16 weights, against cuBLAS (F.linear).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from llm_gemv import SHAPES, graph_of, time_graph

from torchkiln.quantization import gemv, weight_only
from torchkiln.quantization.weight_only import Int4Linear, Int8Linear

CFG8 = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT": s}, num_warps=w, num_stages=st)
        for n, k, w, st in ((8, 512, 4, 3), (16, 512, 4, 3), (16, 512, 8, 4), (32, 256, 4, 3), (8, 1024, 8, 3),
                            (16, 1024, 8, 3), (4, 1024, 4, 3), (32, 512, 8, 3))
        for s in (1, 2, 4, 8)]


def _fits_k(configs, named_args, **kw):  # K splits into whole BLOCK_K steps
    return [c for c in configs if named_args["K"] % (c.kwargs["SPLIT"] * c.kwargs["BLOCK_K"]) == 0]


def _fits_g(configs, named_args, **kw):  # the groups split into whole R steps
    g = named_args["K"] // 128
    return [c for c in configs if g % (c.kwargs["SPLIT"] * c.kwargs["R"]) == 0]


@triton.autotune(configs=CFG8, key=["N", "K"], reset_to_zero=["o_ptr"], prune_configs_by={"early_config_prune": _fits_k})
@triton.jit
def int8_split(x_ptr, w_ptr, s_ptr, o_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    per = K // SPLIT
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * per + tl.arange(0, BLOCK_K)
    keep = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    x_ptrs = x_ptr + rk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(0, per // BLOCK_K):
        w = tl.load(w_ptrs, mask=keep[:, None], other=0)
        x = tl.load(x_ptrs).to(tl.float32)
        wf = ((w.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        acc += wf * x[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1) * tl.load(s_ptr + rn, mask=keep, other=0.0).to(tl.float32)
    if SPLIT == 1:
        tl.store(o_ptr + rn, out, mask=keep)
    else:
        tl.atomic_add(o_ptr + rn, out, mask=keep, sem="relaxed")


CFG4 = [triton.Config({"BLOCK_N": n, "R": r, "SPLIT": s}, num_warps=w, num_stages=st)
        for n, r, w, st in ((16, 2, 4, 3), (16, 4, 4, 3), (32, 2, 4, 3), (32, 4, 8, 3), (8, 4, 4, 3),
                            (8, 8, 4, 3), (64, 2, 8, 3), (16, 8, 8, 4), (4, 8, 4, 3))
        for s in (1, 2, 4, 8)]


@triton.autotune(configs=CFG4, key=["N", "K"], reset_to_zero=["o_ptr"], prune_configs_by={"early_config_prune": _fits_g})
@triton.jit
def int4_v2(x_ptr, p_ptr, s_ptr, z_ptr, o_ptr, N, K, G: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
            SPLIT: tl.constexpr):
    HALF: tl.constexpr = G // 2
    groups = K // G
    per = groups // SPLIT
    g0 = tl.program_id(1) * per
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, R)
    rj = tl.arange(0, HALF)
    keep = rn < N
    p_ptrs = p_ptr + rn[:, None, None].to(tl.int64) * (K // 2) + (g0 + rr)[None, :, None] * HALF + rj[None, None, :]
    x_ptrs = x_ptr + (g0 + rr)[:, None] * G + rj[None, :]
    q_ptrs = rn[:, None].to(tl.int64) * groups + g0 + rr[None, :]
    acc = tl.zeros((BLOCK_N, R, HALF), dtype=tl.float32)
    acc_z = tl.zeros((BLOCK_N, R), dtype=tl.float32)
    for _ in range(0, per // R):
        p = tl.load(p_ptrs, mask=keep[:, None, None], other=0).to(tl.int32)
        lo = ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        s = tl.load(s_ptr + q_ptrs, mask=keep[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + q_ptrs, mask=keep[:, None], other=0.0).to(tl.float32)
        xl = tl.load(x_ptrs).to(tl.float32)
        xh = tl.load(x_ptrs + HALF).to(tl.float32)
        acc += s[:, :, None] * (lo * xl[None, :, :] + hi * xh[None, :, :])
        acc_z += z * tl.sum(xl + xh, axis=1)[None, :]
        p_ptrs += R * HALF
        x_ptrs += R * G
        q_ptrs += R
    out = tl.sum(tl.sum(acc, axis=2) + acc_z, axis=1)
    if SPLIT == 1:
        tl.store(o_ptr + rn, out, mask=keep)
    else:
        tl.atomic_add(o_ptr + rn, out, mask=keep, sem="relaxed")


CFG16 = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT": s}, num_warps=w, num_stages=st)
         for n, k, w, st in ((8, 256, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3), (4, 512, 4, 3),
                             (32, 256, 8, 3), (4, 1024, 4, 3))
         for s in (1, 2, 4)]


@triton.autotune(configs=CFG16, key=["N", "K"], reset_to_zero=["o_ptr"], prune_configs_by={"early_config_prune": _fits_k})
@triton.jit
def bf16_split(x_ptr, w_ptr, o_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    per = K // SPLIT
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * per + tl.arange(0, BLOCK_K)
    keep = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    x_ptrs = x_ptr + rk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(0, per // BLOCK_K):
        w = tl.load(w_ptrs, mask=keep[:, None], other=0.0).to(tl.float32)
        acc += w * tl.load(x_ptrs).to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if SPLIT == 1:
        tl.store(o_ptr + rn, out, mask=keep)
    else:
        tl.atomic_add(o_ptr + rn, out, mask=keep, sem="relaxed")


def grid2(n):
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])


def run_int8_split(x, w, s):
    n, k = w.shape
    out = torch.zeros(n, device=x.device, dtype=torch.float32)
    int8_split[grid2(n)](x, w, s, out, n, k)
    return out


def run_int4_v2(x, p, s, z):
    n, k = p.shape[0], 2 * p.shape[1]
    out = torch.zeros(n, device=x.device, dtype=torch.float32)
    int4_v2[grid2(n)](x, p, s, z, out, n, k, 128)
    return out


def run_bf16(x, w):
    n, k = w.shape
    out = torch.zeros(n, device=x.device, dtype=torch.float32)
    bf16_split[grid2(n)](x, w, out, n, k)
    return out


def main() -> int:
    dev = torch.device("cuda")
    print("| shape | peer | us/call | x bf16 | weight GB/s | best config |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        q8, q4 = Int8Linear(lin), Int4Linear(lin, 128)
        count = max(2, -(-(256 << 20) // (n * k)))
        w16 = [lin.weight.detach().clone() for _ in range(count)]
        w8 = [q8.weight.clone() for _ in range(count)]
        p4 = [q4.packed.clone() for _ in range(count)]
        peers = {
            "bf16 F.linear": (F.linear, [(x, w) for w in w16], 2 * n * k),
            "bf16 triton": (run_bf16, [(x[0], w) for w in w16], 2 * n * k),
            "int8 served": (gemv.int8_linear, [(x, w, q8.scales) for w in w8], n * k),
            "int8 split": (run_int8_split, [(x[0], w, q8.scales) for w in w8], n * k),
            "int4 served": (lambda x, p, s, z: gemv.int4_linear(x, p, s, z, 128),
                            [(x, p, q4.scale, q4.zero) for p in p4], n * k // 2 + 4 * n * (k // 128)),
            "int4 v2": (run_int4_v2, [(x[0], p, q4.scale, q4.zero) for p in p4], n * k // 2 + 4 * n * (k // 128)),
        }
        for tiles in (2, 4, 8):  # tinygemm's inner K tiles (torchkiln serves 8)
            weight_only.TINYGEMM_TILES = tiles
            tg = [Int4Linear(lin, 128, tinygemm=True) for _ in range(count)]
            peers[f"int4 tinygemm ikt{tiles}"] = (lambda x, m: m(x), [(x, m) for m in tg], n * k // 2 + 4 * n * (k // 128))
        weight_only.TINYGEMM_TILES = 8
        ref = F.linear(x, lin.weight).float().view(-1)
        ref8 = gemv.int8_linear(x, q8.weight, q8.scales).float().view(-1)
        ref4 = gemv.int4_linear(x, q4.packed, q4.scale, q4.zero, 128).float().view(-1)
        graphs = {}
        for p, (fn, args, _) in peers.items():
            got = fn(*args[0]).float().view(-1)
            want = ref8 if p.startswith("int8") else ref4 if p.startswith("int4") else ref
            if "tinygemm" in p:
                want = ref4  # the same q, scale and zero: within bf16 rounding of the Triton int4 GEMV
            err = float((got - want).norm() / want.norm())
            if err > 2e-2:
                print(f"  {name} {p}: relative error {err:.4f} against its reference; skipped")
                continue
            graphs[p] = graph_of(fn, args)
        times = {p: [] for p in graphs}
        for _ in range(5):
            for p, g in graphs.items():
                times[p].append(time_graph(g) / count)
        base = statistics.median(times["bf16 F.linear"])
        best = {"bf16 triton": bf16_split, "int8 split": int8_split, "int4 v2": int4_v2}
        for p, t in times.items():
            s = statistics.median(t)
            cfg = best[p].best_config if p in best else ""
            print(f"| {name} {n}x{k} | {p} | {s * 1e6:.1f} | {base / s:.2f} | {peers[p][2] / s / 1e9:.0f} | {cfg} |",
                  flush=True)
        del peers, graphs, w16, w8, p4
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
