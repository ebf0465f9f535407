"""Page faults and kernel time per CPU training step, with glibc malloc's defaults and with
torchkiln's setting (runtime/allocator.py), for the stock recipe and for torchkiln.

    python benchmarks/diag_page_faults.py --model bert-base --batch 8 --seq 128 --steps 8

Each configuration runs in a fresh process, one after another (the setting is process-wide and
cannot be undone): build, 3 warm-up steps, then --steps measured steps. Prints, per configuration,
the median step time, minor page faults, kernel (system) CPU seconds per step and peak RSS. The
step times of separate processes are indicative only; train_step.py interleaves them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from train_step import makers_for, setup, step_args

CONFIGS = {  # name -> train_step peer (its knobs or its malloc setting come with it)
    "stock, glibc defaults": "compile+autocast",
    "stock, malloc keeps freed memory": "compile+autocast malloc-keep",
    "torchkiln, cpu_allocator='default'": "torchkiln malloc-default",
    "torchkiln (keeps freed memory)": "torchkiln",
}


def child(a, name):
    import torch

    a.peers = CONFIGS[name]
    base, batch = setup(a)
    step = next(iter(makers_for(a, batch, getattr(torch, a.dtype), {}).values()))(base)
    for _ in range(3):
        step()
    ms, faults, sys_s = [], [], []
    for _ in range(a.steps):
        r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        ms.append((time.perf_counter() - t) * 1e3)
        faults.append(r1.ru_minflt - r0.ru_minflt)
        sys_s.append(r1.ru_stime - r0.ru_stime)
    print(json.dumps({"ms": statistics.median(ms), "faults": statistics.median(faults),
                      "sys_s": statistics.median(sys_s), "rss_gib": r1.ru_maxrss / 2**20}))


def main():
    ap = step_args(0.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a, a.child)
    print(f"\nCommand: `python {' '.join(sys.argv)}` (one fresh process per row, medians over {a.steps} steps)\n")
    print("| configuration | ms/step | minor page faults/step | kernel s/step | peak RSS GiB |")
    print("|---|---|---|---|---|")
    for name in CONFIGS:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", name], capture_output=True,
                             text=True)
        if out.returncode:
            print(f"| {name} | failed: {out.stderr.strip().splitlines()[-1]} | | | |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['ms']:.1f} | {r['faults']:,.0f} | {r['sys_s']:.2f} | {r['rss_gib']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
