"""The layout `tk.runtime.autotune` finds against one instance on every core, for zoo models through
tk.optimize. Each layout runs as `torchkiln run` would start it (one process per instance, pinned, its own
OpenMP team); the layouts are interleaved round by round and the median round counts.

    python benchmarks/runtime_autotune.py --model resnet50,bert-base --batch 2,16 --dtype bfloat16
    python benchmarks/runtime_autotune.py --model resnet50 --batch 16 --instances 1,2,4,8 --rounds 3

Prints one markdown table per (model, batch) for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import torch

import torchkiln as tk
from torchkiln import zoo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", default="2,16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--instances", help="counts to try, e.g. 1,2,4,8 (default: the tuner's candidates)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    counts = [int(k) for k in a.instances.split(",")] if a.instances else None
    dtype = getattr(torch, a.dtype)
    print(f"\n### {datetime.date.today()} layout autotune, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}\n\nCommand: `python {' '.join(sys.argv)}`\n")
    for name in a.model.split(","):
        for batch in (int(b) for b in a.batch.split(",")):
            model, x = zoo.load(name, batch=batch)
            tuned = tk.runtime.autotune(model.eval(), x, dtype=dtype, instances=counts, seconds=a.seconds,
                                        rounds=a.rounds)
            one = tuned.trials[0]  # one instance on a whole node
            print(f"\n{name} bs{batch} {a.dtype}, {a.rounds} rounds x {a.seconds:.0f} s, machine "
                  f"{tuned.machine['cpu_model']} ({tuned.machine['physical_cores']} cores)\n")
            print("| layout | items/s (median round) | rounds | latency ms | vs 1 instance |\n|---|---|---|---|---|")
            for t in tuned.trials:
                if t.error:
                    print(f"| {t.instances} x {t.cores_per_instance} | failed: {t.error} | | | |")
                    continue
                best = " (best)" if (t.instances, t.cores_per_instance) == (
                    tuned.best["instances"], tuned.best["cores_per_instance"]) else ""
                rounds = " / ".join(f"{r:.1f}" for r in t.rounds)
                print(f"| {t.instances} x {t.cores_per_instance}{best} | {t.items_per_s:.1f} | {rounds} | "
                      f"{t.latency_ms:.1f} | {t.items_per_s / one.items_per_s:.2f}x |")


if __name__ == "__main__":
    main()
