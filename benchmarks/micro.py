"""The micro-measurements behind torchkiln's CPU decisions, reproducible:

1. fp32/bf16 linear: stock aten (BLAS) vs oneDNN packed, GFLOP/s (onednn_linear pass, plan/cpu.py);
2. attention per layer: SDPA (flash kernel) vs the math form (passes/sdpa_math.py);
3. bert-base bf16 bs1 under torchkiln with and without the oneDNN linear module (why that pass is fp32-only).

    python benchmarks/micro.py            # prints a markdown section; append it to RESULTS.md
"""

import statistics

import torch
import torch.nn.functional as F

import torchkiln as tk
from torchkiln import zoo
from torchkiln.passes.onednn_linear import measure
from torchkiln.passes.sdpa_math import sdpa_math
from torchkiln.timing import median_seconds

print("| linear M x K x N | dtype | aten GFLOP/s | oneDNN packed GFLOP/s |\n|---|---|---|---|")
for m, k, n in [(128, 768, 768), (128, 768, 3072), (128, 3072, 768), (1024, 768, 768)]:
    for dt in (torch.float32, torch.bfloat16):
        r = measure(dt, m, k, n, iters=20)
        print(f"| {m}x{k}x{n} | {str(dt)[6:]} | {r['aten']} | {r['onednn']} |")

print("\n| attention (1, 12, 128, 64) | dtype | SDPA us | math us |\n|---|---|---|---|")
for dt in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(1, 12, 128, 64).to(dt) for _ in range(3))
    with torch.no_grad():
        t_sdpa = median_seconds(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v), iters=50)
        t_math = median_seconds(lambda q=q, k=k, v=v: sdpa_math(q, k, v, None, False, None, False), iters=50)
    print(f"| bert-base layer | {str(dt)[6:]} | {t_sdpa * 1e6:.0f} | {t_math * 1e6:.0f} |")

model, x = zoo.load("bert-base", batch=1)
variants = {"inductor packs linears (default)": tk.optimize(model, dtype="bf16", sample_input=x),
            "oneDNN linear module forced": tk.optimize(model, dtype="bf16", sample_input=x, weights_prepack=True)}
times: dict = {k: [] for k in variants}
with torch.no_grad():
    for _ in range(5):  # interleaved rounds
        for name, fn in variants.items():
            times[name].append(median_seconds(lambda fn=fn: fn(**x), warmup=2, iters=6))
print("\n| bert-base bf16 bs1, torchkiln O1 | median ms |\n|---|---|")
for name, ts in times.items():
    print(f"| {name} | {statistics.median(ts) * 1e3:.1f} |")
