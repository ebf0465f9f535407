"""Decode GEMVs on the CPU: dense against the weight-only forms tk.llm can serve, llama-350m's shapes.

    python benchmarks/llm_gemv_cpu.py

Peers per shape and row count, interleaved over rounds (medians): dense F.linear; RowLinear (the
decode step's form: one row as a multiply-and-sum, compiled into a reduction; more rows, F.linear); the int8
expression ``F.linear(x, q.to(dtype)) * scale`` compiled; at one row, the int8 reduction
``(x * q).sum(-1) * scale`` compiled (RowLinear's form on int8 weights); torch's ``_weight_int8pack_mm``; and
torch's ``_weight_int4pack_mm_for_cpu`` (bf16 only, where this torch has it); and torchkiln's own CPU
GEMV (``torchkiln::cpu_gemv``, kernels/cpu_gemv.cpp) on the dense and the int8 weights, where it
builds. GB/s counts the
weight bytes read once per call. Each peer cycles through copies of its weights (>= 128 MB in all),
so they come from DRAM, not the L3 cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from torchkiln.kernels import cpu_gemv
from torchkiln.llm.model import RowLinear, linear_of
from torchkiln.quantization.weight_only import Int4Linear, Int8Linear

SHAPES = {"qkv": (3072, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}


def one(fn, copies, reps: int) -> float:
    t = time.perf_counter()
    for i in range(reps):
        fn(*copies[i % len(copies)])
    return (time.perf_counter() - t) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    a = ap.parse_args()
    torch.manual_seed(0)
    # one compiled RowLinear per weight copy: they share forward's code, and each is a recompile
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    why = cpu_gemv.load()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; torchkiln's kernel: {why or 'built'}")
    print("| shape (N x K) | dtype | rows | peer | us/call | x dense | weight GB/s |")
    print("|---|---|---|---|---|---|---|")
    for dname in a.dtypes.split(","):
        dt = getattr(torch, dname)
        for name, (n, k) in SHAPES.items():
            lin = torch.nn.Linear(k, n, bias=False).to(dt)
            q8 = Int8Linear(lin)
            expr = torch.compile(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s)
            red8 = torch.compile(lambda x, w, s: ((x.unsqueeze(-2).float() * w.float()).sum(-1) * s).to(x.dtype))
            for rows in (int(r) for r in a.rows.split(",")):
                x = torch.randn(rows, k, dtype=dt)
                count = max(2, (128 << 20) // (n * k))
                peers = {"dense": (F.linear, [(x, lin.weight.detach().clone()) for _ in range(count)],
                                   n * k * lin.weight.element_size()),
                         "int8 expression (compiled)": (expr, [(x, q8.weight.clone(), q8.scales)] * 1, n * k),
                         "int8 _weight_int8pack_mm": (torch.ops.aten._weight_int8pack_mm,
                                                      [(x, q8.weight.clone(), q8.scales) for _ in range(count)], n * k)}
                peers["int8 expression (compiled)"] = (expr, peers["int8 _weight_int8pack_mm"][1], n * k)
                if rows == 1:
                    peers["int8 reduction (compiled)"] = (red8, peers["int8 _weight_int8pack_mm"][1], n * k)
                rows_lin = [torch.compile(linear_of(w, None, RowLinear), dynamic=False) for _, w in peers["dense"][1]]
                peers["RowLinear (compiled)"] = (lambda x, m: m(x), [(x, m) for m in rows_lin],
                                                 n * k * lin.weight.element_size())
                if dt == torch.bfloat16 and Int4Linear.fits_tinygemm(lin, 128):
                    q4s = [Int4Linear(lin, 128, tinygemm=True) for _ in range(count)]
                    peers["int4 _weight_int4pack_mm_for_cpu"] = (lambda x, m: m(x), [(x, m) for m in q4s],
                                                                 n * k // 2 + 4 * n * (k // 128))
                if why is None:
                    peers["kernel"] = (cpu_gemv.gemv, peers["dense"][1], peers["dense"][2])
                    peers["int8 kernel"] = (cpu_gemv.gemv, peers["int8 _weight_int8pack_mm"][1], n * k)
                ref = F.linear(x.float(), lin.weight.float())
                for p, (fn, copies, _) in peers.items():
                    err = float((fn(*copies[0]).float() - ref).norm() / ref.norm())
                    assert err < 0.1, (p, err)  # int4 groups of 128: ~5e-2 on random weights
                    one(fn, copies, count)
                reps = max(count, int(0.05 / one(F.linear, peers["dense"][1], count)))
                times = {p: [] for p in peers}
                for _ in range(a.rounds):
                    for p, (fn, copies, _) in peers.items():
                        times[p].append(one(fn, copies, reps))
                base = statistics.median(times["dense"])
                for p, t in times.items():
                    s = statistics.median(t)
                    print(f"| {name} {n}x{k} | {dname} | {rows} | {p} | {s * 1e6:.0f} | {base / s:.2f} | "
                          f"{peers[p][2] / s / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
