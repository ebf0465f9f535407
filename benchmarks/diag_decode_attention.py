"""The decode step's one-query attention alone: torch's SDPA (boolean cache mask, grouped KV heads)
against torchkiln's Triton kernel (torchkiln/llm/decode_attention.py) at several launch shapes.
Each variant is 32 calls over 32 layers' caches inside one CUDA graph, as in the decode step
(Llama-3-8B's heads: 32 query, 8 KV, head_dim 128, batch 1); us per call, medians of 7 replays.

    python benchmarks/diag_decode_attention.py --slots 256,1024,4096
"""

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from torchkiln.llm import decode_attention as da


def graph_time(fn, reps: int = 7) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def measure(S: int, layers: int, configs, dev, B=1, H=32, KV=8, D=128) -> None:
    q = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16)
    ks = [torch.randn(B, KV, S, D, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    vs = [torch.randn_like(k) for k in ks]
    slot = S * 3 // 4
    mask = (torch.arange(S, device=dev) <= slot)[None, None, None, :]
    out = {}

    def sdpa():
        out["sdpa"] = [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)
                       for k, v in zip(ks, vs, strict=True)]

    rows = [("SDPA (torch's choice)", graph_time(sdpa), 0.0)]
    for block, splits, warps in configs:
        if splits > 1 and block * splits > S * 2:
            continue  # chunks past the cache's end: same as fewer splits
        da.BLOCK_S, da.MAX_SPLITS, da.NUM_WARPS = block, splits, warps

        def kernel():
            out["k"] = [da.attend(q, k, v, mask, D ** -0.5) for k, v in zip(ks, vs, strict=True)]

        us = graph_time(kernel)
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(out["k"], out["sdpa"], strict=True))
        rows.append((f"kernel BLOCK_S {block}, splits {da.splits_for(S)}, warps {warps}", us, diff))
    base = rows[0][1]
    for name, us, diff in sorted(rows, key=lambda r: r[1])[:8] + [rows[0]]:
        print(f"| {S} | {name} | {us / layers:.2f} ({base / us:.2f}x SDPA) | {diff:.3g} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", default="256,1024,4096")
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args()
    dev = torch.device("cuda")
    da.wanted(dev)
    B, H, KV, D = 1, 32, 8, 128
    configs = [(b, sp, w) for b, sp, w in itertools.product((16, 32, 64), (1, 2, 4, 8, 16), (1, 2, 4))]
    print("| slots | variant | us/call | max abs diff vs SDPA |\n|---|---|---|---|")
    for S in [int(x) for x in a.slots.split(",")]:
        measure(S, a.layers, configs, dev, B, H, KV, D)

if __name__ == "__main__":
    main()
