"""MultiStreamModule: N streams (each pinned to its own cores, its part of the batch) against
one call on every core, for a zoo model through tk.optimize; interleaved in one process.

    python benchmarks/runtime_streams.py --model bert-base --batch 16
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import torch

import torchkiln as tk
from torchkiln import inputs, zoo
from torchkiln.runtime import CPUPool, MultiStreamModule
from torchkiln.timing import interleaved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget", type=float, default=20.0)
    a = ap.parse_args()
    model, x = zoo.load(a.model, batch=a.batch)
    model.eval()
    args, kwargs = inputs.normalize(x)
    fast = tk.optimize(model, dtype=getattr(torch, a.dtype), sample_input=x)
    pool = CPUPool()
    fns = {"1 call, all cores": lambda: fast(*args, **kwargs)}
    for n in range(2, len(pool.core_ids) + 1):
        ms = MultiStreamModule(fast, num_streams=n, pool=pool)
        fns[f"{n} streams"] = lambda ms=ms: ms(*args, **kwargs)
    with torch.no_grad():
        for f in fns.values():
            f()
        times = interleaved(fns, torch.device("cpu"), a.budget, min_rounds=5, prune=100)
    med = {k: statistics.median(t) for k, t in times.items()}
    base = med["1 call, all cores"]
    print(f"\n### {datetime.date.today()} MultiStreamModule, {a.model} bs{a.batch} {a.dtype}, "
          f"{len(pool.core_ids)} cores, torch {torch.__version__}\n\nCommand: `python {' '.join(sys.argv)}` "
          f"({min(len(t) for t in times.values())}+ interleaved rounds)\n")
    print("| layout | ms/batch | items/s | vs 1 call |\n|---|---|---|---|")
    for k, m in med.items():
        print(f"| {k} | {1e3 * m:.1f} | {a.batch / m:.1f} | {base / m:.2f}x |")


if __name__ == "__main__":
    main()
