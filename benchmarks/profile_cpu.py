"""Where the CPU time goes in a torchkiln-optimized zoo model: top ops by self CPU time.

    python benchmarks/profile_cpu.py resnet50 1 float32
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import torchkiln as tk
from torchkiln import inputs, zoo

name, batch, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model, x = zoo.load(name, batch=batch)
o = tk.optimize(model, dtype=dtype, sample_input=x)
a, k = inputs.normalize(x)
with torch.no_grad():
    for _ in range(5):
        o(*a, **k)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            o(*a, **k)
total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 10 / 1e3
print(f"{name} bs{batch} {dtype} ({o.kiln_report.active}): {total:.2f} ms/call")
for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]:
    share = e.self_cpu_time_total / 10 / 1e3
    print(f"  {e.key[:60]:<60} {share:7.2f} ms/call  {100 * share / total:5.1f}%  ({e.count // 10} calls)")
