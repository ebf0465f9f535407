"""Decode GEMVs on CUDA: bf16 against int8/int4 weight-only, the kernels tk.llm serves.

    python benchmarks/llm_gemv.py            # Llama-3-8B's shapes, 1 and 4 rows

Each peer runs inside one CUDA graph over enough weight copies (>= 256 MB) that the weights
come from HBM, not the 50 MB L2; time per call = graph time / copies, median of rounds,
peers interleaved per round. GB/s counts the weight bytes (and scales) read once per call,
against a device copy (read + write) timed in the same run.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from torchkiln.quantization import gemv
from torchkiln.quantization.weight_only import Int4Linear, Int8Linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}


def graph_of(fn, copies):
    """A CUDA graph calling fn once per weight copy (warmed up first, outside capture)."""
    for c in copies:
        fn(*c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in copies:
            fn(*c)
    return g


def time_graph(g, reps=20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3  # seconds per replay


def interleaved(graphs: dict, rounds: int, calls: dict | int) -> dict:
    """name -> median seconds per call: each graph replayed once per round, the graphs in turn;
    ``calls``: the calls inside each graph (one count for all, or per name)."""
    times = {p: [] for p in graphs}
    for _ in range(rounds):
        for p, g in graphs.items():
            times[p].append(time_graph(g) / (calls if isinstance(calls, int) else calls[p]))
    return {p: statistics.median(t) for p, t in times.items()}


def peers(n, k, rows, dev):
    """name -> (fn, list of argument tuples, bytes per call)."""
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    q8, q4 = Int8Linear(lin), Int4Linear(lin, 128)
    assert q8.kernel and q4.kernel
    count = max(2, -(-(256 << 20) // (n * k)))  # copies: >= 256 MB of int8 weights
    expr8 = torch.compile(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s)
    out = {
        "bf16 F.linear": (F.linear, [(x, lin.weight.detach().clone()) for _ in range(count)], 2 * n * k),
        "int8 expression (compiled)": (expr8, [(x, q8.weight.clone(), q8.scales) for _ in range(count)],
                                       n * k + 2 * n),
        "int8 kernel": (gemv.int8_linear, [(x, q8.weight.clone(), q8.scales) for _ in range(count)], n * k + 2 * n),
        "int4 kernel": (lambda x, p, s, z: gemv.int4_linear(x, p, s, z, 128),
                        [(x, q4.packed.clone(), q4.scale, q4.zero) for _ in range(count)],
                        n * k // 2 + 4 * n * (k // 128)),
    }
    try:
        import torchao  # noqa: F401

        from torchkiln.quantization.config import QuantConfig
        from torchkiln.quantization.schemes import torchao as tao
        from torchkiln.quantization.schemes import torchao_config

        cfg = torchao_config(QuantConfig("int4-weight-only"), dev)
        mods = []
        for _ in range(count):
            m = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16))
            m[0].weight.data.copy_(lin.weight.data)
            tao().quantize_(m, cfg)
            mods.append((x, m))
        out["int4 torchao tinygemm"] = (lambda x, m: m(x), mods, n * k // 2 + 4 * n * (k // 128))
    except Exception as e:  # noqa: BLE001 - the image may lack torchao
        print(f"  (torchao int4 peer skipped: {type(e).__name__}: {e})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    big = torch.empty(1 << 28, device=dev)
    other = torch.empty_like(big)
    copy_gbs = 2 * big.numel() * 4 / statistics.median(
        time_graph(graph_of(lambda a, b: b.copy_(a), [(big, other)])) for _ in range(5)) / 1e9
    del big, other
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; copy bandwidth (read + write) "
          f"{copy_gbs:.0f} GB/s")
    print("| shape (N x K) | rows | peer | us/call | x bf16 | weight GB/s | % of copy bw |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        for rows in (int(r) for r in a.rows.split(",")):
            ps = peers(n, k, rows, dev)
            ref = F.linear(*ps["bf16 F.linear"][1][0]).float()
            graphs = {}
            for p, (fn, args, _) in ps.items():
                err = float((fn(*args[0]).float() - ref).norm() / ref.norm())
                if err > 0.2:
                    print(f"  {p}: relative error {err:.3f} against bf16; skipped")
                    continue
                graphs[p] = graph_of(fn, args)
            times = interleaved(graphs, a.rounds, {p: len(ps[p][1]) for p in graphs})
            base = times["bf16 F.linear"]
            for p, s in times.items():
                gbs = ps[p][2] / s / 1e9
                print(f"| {name} {n}x{k} | {rows} | {p} | {s * 1e6:.1f} | {base / s:.2f} | {gbs:.0f} | "
                      f"{gbs / copy_gbs:.0%} |")
            del ps, graphs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
