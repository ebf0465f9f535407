"""How the CUDA weight-only kernels scale with the rows of x (decode batches, prefill widths), at
Llama-3-8B's shapes, each inside one CUDA graph over >= 256 MB of weight copies (llm_gemv.py's
harness). Run on the GPU:

    python benchmarks/diag_rows.py [--rows 2,4,8,16,64,256] [--shapes qkv,gate_up,down]

Peers: bf16 cuBLAS; int8 as served (gemv.int8_linear: the one-row GEMV, the int8 matmul kernel from 2
rows in bf16); int4 tinygemm; int4 in tinygemm's layout
dequantized to bf16 then cuBLAS (gemv.tinygemm_dense); int4 as served (Int4Linear: tinygemm up to
TINYGEMM_ROWS rows, the dequantized form above); up to 16 rows, the candidate int4 kernel on
tinygemm's tiles (int4_tiles.py, not served).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from int4_tiles import kernel as int4_tiles
from llm_gemv import SHAPES, graph_of, time_graph

from torchkiln.quantization import gemv
from torchkiln.quantization.weight_only import Int4Linear, Int8Linear


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2,4,8,16,64,256")
    ap.add_argument("--shapes", default="qkv,gate_up,down")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")

    tiles = int4_tiles()

    def dense(x, m):
        return F.linear(x, gemv.tinygemm_dense(m.packed, m.scale_zero, m.order, 128))

    print("| shape | rows | peer | us/call | x bf16 |")
    print("|---|---|---|---|---|")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        q8, q4 = Int8Linear(lin), Int4Linear(lin, 128)
        count = max(2, -(-(256 << 20) // (n * k)))
        w16 = [lin.weight.detach().clone() for _ in range(count)]
        w8 = [q8.weight.clone() for _ in range(count)]
        tg = [Int4Linear(lin, 128, tinygemm=True) for _ in range(count)]
        # references computed another way: the weights dequantized in float32 from the Triton layout
        grp = q4.packed.view(n, k // 128, 64)
        q = torch.cat((grp & 0xF, grp >> 4), dim=-1).float()
        w4f = (q * q4.scale.float()[..., None] + q4.zero.float()[..., None]).view(n, k)
        w8f = q8.weight.float() * q8.scales.float()[:, None]
        got = gemv.tinygemm_dense(tg[0].packed, tg[0].scale_zero, tg[0].order, 128).float()
        print(f"  {name}: tinygemm_dense against the codes: max |diff| {float((got - w4f).abs().max()):.2e} "
              f"(weights up to {float(w4f.abs().max()):.2e})")
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            peers = {
                "bf16 F.linear": (F.linear, [(x, w) for w in w16], lin.weight.float()),
                "int8 served": (gemv.int8_linear, [(x, w, q8.scales) for w in w8], w8f),
                "int4 tinygemm": (lambda x, m: torch.ops.aten._weight_int4pack_mm(x, m.packed, 128, m.scale_zero),
                                  [(x, m) for m in tg], w4f),
                "int4 served (Int4Linear)": (lambda x, m: m(x), [(x, m) for m in tg], w4f),
                "int4 tinygemm dequantized + cuBLAS": (dense, [(x, m) for m in tg], w4f),
            }
            if rows <= 16:
                peers["int4 Triton on tinygemm's tiles"] = (lambda x, m: tiles(x, m.packed, m.scale_zero, 128),
                                                             [(x, m) for m in tg], w4f)
            graphs = {}
            with torch.no_grad():
                for p, (fn, a, ref) in peers.items():
                    try:
                        got = fn(*a[0]).float()
                    except Exception as e:  # noqa: BLE001 (a candidate that does not build: say so, go on)
                        print(f"  {name} rows {rows} {p}: failed, {type(e).__name__}: {str(e)[:200]}")
                        continue
                    want = x.float() @ ref.T
                    err = float((got - want).norm() / want.norm())
                    if err > 1e-2:
                        print(f"  {name} rows {rows} {p}: relative error {err:.4f} against its reference; skipped")
                        continue
                    graphs[p] = graph_of(fn, a)
            times = {p: [] for p in graphs}
            for _ in range(args.rounds):
                for p, g in graphs.items():
                    times[p].append(time_graph(g, reps=5 if rows > 16 else 20) / count)
            base = statistics.median(times["bf16 F.linear"])
            for p, t in times.items():
                s = statistics.median(t)
                print(f"| {name} {n}x{k} | {rows} | {p} | {s * 1e6:.1f} | {base / s:.2f} |", flush=True)
            del peers, graphs
        del w16, w8, tg
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
