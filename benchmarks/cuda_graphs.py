"""Does CUDA-graph replay pay? torchkiln O1 with and without graphs, and the
torch.compile bf16 peer, timed interleaved in one process.

    python benchmarks/cuda_graphs.py bert-base 1 64
"""

import copy
import statistics
import sys

import torch

import torchkiln as tk
from torchkiln import inputs, zoo
from torchkiln.bench import _time
from torchkiln.passes import compile_model

name = sys.argv[1]
for batch in map(int, sys.argv[2:]):
    model, x = zoo.load(name, batch=batch)
    model = model.cuda()
    a, k = inputs.to(inputs.normalize(x), "cuda")
    sample = a if a else k
    runs = {
        "peer compile bf16-cast": (compile_model(copy.deepcopy(model).to(torch.bfloat16), {}),
                                   *inputs.to((a, k), dtype=torch.bfloat16)),
        "torchkiln O1": (tk.optimize(model, dtype="bf16", sample_input=sample), a, k),
        "torchkiln O1 + graphs": (tk.optimize(model, dtype="bf16", sample_input=sample,
                                              compile_options={"triton.cudagraphs": True}), a, k),
    }
    times = {n: [] for n in runs}
    dev = torch.device("cuda")
    with torch.no_grad():
        for _ in range(5):
            for n, (fn, aa, kk) in runs.items():
                times[n] += _time(fn, aa, kk, dev, warmup=2, iters=20)
    base = statistics.median(times["peer compile bf16-cast"])
    for n, ts in times.items():
        med = statistics.median(ts)
        print(f"{name} bs{batch} {n:<24} {med * 1e3:7.3f} ms  {base / med:5.2f}x vs peer")
