"""One-row decode GEMVs: the 32-bit-word kernels tk.llm serves (quantization/gemv.py, ONE_ROW="words")
against the per-byte kernels they replaced, tinygemm and bf16 cuBLAS, at Llama-3-8B's shapes, each
inside one CUDA graph over >= 256 MB of weight copies (llm_gemv.py's harness). Run on the GPU:

    python benchmarks/diag_gemv_variants.py

(The split-K and 3-D-accumulator candidates this script measured before are in RESULTS.md, "Triton
int8/int4 decode GEMVs"; they did not pay and were removed.)
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from llm_gemv import SHAPES, graph_of, time_graph

from torchkiln.quantization import gemv
from torchkiln.quantization.weight_only import Int4Linear, Int8Linear


def one_row(kind: str, mode: str):
    """The served op with the one-row kernel ``mode`` ("words" or "bytes") chosen while it is captured."""
    def call(*args):
        old, gemv.ONE_ROW = gemv.ONE_ROW, mode
        try:
            return gemv.int8_linear(*args) if kind == "int8" else gemv.int4_linear(*args, 128)
        finally:
            gemv.ONE_ROW = old
    return call


def main() -> int:
    dev = torch.device("cuda")
    print("| shape | peer | us/call | x bf16 | weight GB/s | tuned config (last shape tuned) |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        q8, q4 = Int8Linear(lin), Int4Linear(lin, 128)
        count = max(2, -(-(256 << 20) // (n * k)))
        w16 = [lin.weight.detach().clone() for _ in range(count)]
        w8 = [q8.weight.clone() for _ in range(count)]
        p4 = [q4.packed.clone() for _ in range(count)]
        tg = [Int4Linear(lin, 128, tinygemm=True) for _ in range(count)]
        b4 = n * k // 2 + 4 * n * (k // 128)
        peers = {
            "bf16 F.linear": (F.linear, [(x, w) for w in w16], 2 * n * k),
            "int8 bytes": (one_row("int8", "bytes"), [(x, w, q8.scales) for w in w8], n * k),
            "int8 words": (one_row("int8", "words"), [(x, w, q8.scales) for w in w8], n * k),
            "int4 bytes": (one_row("int4", "bytes"), [(x, p, q4.scale, q4.zero) for p in p4], b4),
            "int4 words": (one_row("int4", "words"), [(x, p, q4.scale, q4.zero) for p in p4], b4),
            "int4 tinygemm": (lambda x, m: m(x), [(x, m) for m in tg], b4),
        }
        # references computed another way: the weights dequantized in float32
        w8f = q8.weight.float() * q8.scales.float()[:, None]
        grp = q4.packed.view(n, k // 128, 64)
        q = torch.cat((grp & 0xF, grp >> 4), dim=-1).float()
        w4f = (q * q4.scale.float()[..., None] + q4.zero.float()[..., None]).view(n, k)
        refs = {"bf16": lin.weight.float(), "int8": w8f, "int4": w4f}
        graphs = {}
        for p, (fn, args, _) in peers.items():
            got = fn(*args[0]).float().view(-1)
            want = (x.float() @ refs[p.split()[0]].T).view(-1)
            err = float((got - want).norm() / want.norm())
            if err > 1e-2:
                print(f"  {name} {p}: relative error {err:.4f} against its reference; skipped")
                continue
            graphs[p] = graph_of(fn, args)
        times = {p: [] for p in graphs}
        for _ in range(5):
            for p, g in graphs.items():
                times[p].append(time_graph(g) / count)
        base = statistics.median(times["bf16 F.linear"])
        for p, t in times.items():
            s = statistics.median(t)
            kern = gemv.KERNELS.get(p.replace(" ", "_"))
            cfg = kern.best_config if kern is not None and hasattr(kern, "best_config") else ""
            print(f"| {name} {n}x{k} | {p} | {s * 1e6:.1f} | {base / s:.2f} | {peers[p][2] / s / 1e9:.0f} | {cfg} |",
                  flush=True)
        del peers, graphs, w16, w8, p4, tg
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
