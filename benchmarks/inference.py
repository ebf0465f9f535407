"""Side-by-side inference benchmark: torchkiln against the stock-PyTorch peers.

Runs each (model, batch, dtype) case through tk.bench (every peer built first,
then timed in interleaved rounds in this one process), measures the machine's
GEMM peak for each dtype in the same run, prints the tables with the ratio to
the best peer and the issue's target, and appends them to benchmarks/RESULTS.md.

    python benchmarks/inference.py                 # the CPU suite (about 15 min on 2 cores)
    python benchmarks/inference.py --device cuda   # the H200 suite
    python benchmarks/inference.py --case bert-base:1:float32   # one case
    python benchmarks/inference.py --device cuda --autotune-peers   # + max-autotune peers
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

import torchkiln as tk
from torchkiln import zoo
from torchkiln.bench import bench, gemm_peak
from torchkiln.modelutil import parse_dtype

# (model, batch, dtype) -> target speedup over the best peer, from the inference issue.
CPU_CASES = {
    ("resnet50", 1, "float32"): 1.15, ("resnet50", 16, "float32"): 1.15,
    ("resnet50", 1, "bfloat16"): 1.2, ("resnet50", 16, "bfloat16"): 1.2,
    ("bert-base", 1, "float32"): 2.0, ("bert-base", 8, "float32"): 2.0,
    ("bert-base", 1, "bfloat16"): 1.15, ("bert-base", 8, "bfloat16"): 1.15,
}
# The trust issue's H200 targets, over the best of eager bf16, compile and compile reduce-overhead.
CUDA_CASES = {("bert-base", 64, "bfloat16"): 1.2, ("bert-base", 1, "bfloat16"): 1.3, ("resnet50", 256, "bfloat16"): 1.1}


def hardware_line(device: torch.device) -> str:
    hw = tk.detect()
    if device.type == "cuda":
        acc = hw.accelerator(str(device)) or hw.accelerators[0]
        return f"{acc.name} (cc {acc.capability}), torch {torch.__version__}"
    c = hw.cpu
    return (f"{c.vendor} {c.model}, {c.physical_cores} cores, ISA {'/'.join(c.features)}, "
            f"torch {torch.__version__}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--case", action="append", help="model:batch:dtype (repeatable); default: the suite")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--levels", default="O1", help="torchkiln levels to time, e.g. O1,O2")
    p.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    p.add_argument("--json", help="also write all results here")
    p.add_argument("--autotune-peers", action="store_true",
                   help="also time torch.compile max-autotune-no-cudagraphs peers (CUDA; slow to build)")
    p.add_argument("--peers", help="comma list of stock peers to time (default: all for the device and dtype)")
    args = p.parse_args()
    device = torch.device(args.device)
    suite = CUDA_CASES if device.type == "cuda" else CPU_CASES
    if args.case:
        cases = {}
        for c in args.case:
            name, batch, dtype = c.split(":")
            cases[(name, int(batch), dtype)] = suite.get((name, int(batch), dtype))
    else:
        cases = suite
    kiln = [f"torchkiln-{lvl}" for lvl in args.levels.split(",")]
    peaks: dict[str, float] = {}
    out, summary = [], []
    hw_line = hardware_line(device)
    cmd = "python " + " ".join(sys.argv)
    with open(args.results, "a") as f:
        f.write(f"\n### {datetime.date.today()} {device.type}: {hw_line}\n\nCommand: `{cmd}` (medians over "
                f"{args.iters} calls per peer in {args.rounds} interleaved rounds; every peer built first)\n")
    for (name, batch, dtype), target in cases.items():
        dt = parse_dtype(dtype)
        if dtype not in peaks:
            peaks[dtype] = gemm_peak(dt, device)
        model, sample = zoo.load(name, batch=batch)
        t0 = time.time()
        res = bench(model, sample, dtype=dt, device=device, iters=args.iters, rounds=args.rounds, name=name,
                    progress=sys.stderr.isatty(), gemm_peak_gflops=peaks[dtype], autotune_peers=args.autotune_peers,
                    peers=(args.peers.split(",") + kiln) if args.peers else
                    None if kiln == ["torchkiln-O1"] else list(_all_peers(device, dt, args.autotune_peers)) + kiln)
        table = res.table()
        ratio = res.vs_best_peer()
        verdict = f"target {target}x: {'MET' if ratio and target and ratio >= target else 'MISSED'}" if target else ""
        print(table + (f"\n{verdict}" if verdict else "") + f"\n({time.time() - t0:.0f} s)\n", flush=True)
        peer, best = res.best_peer(), res.best_kiln()
        # dtype is the one torchkiln served (the peer was picked at it), not the one asked
        summary.append(f"| {name} | {batch} | {dtype} | {best.dtype} | {peer.name if peer else '-'} | "
                       f"{f'{peer.median_ms:.2f}' if peer else '-'} | {best.median_ms:.2f} | "
                       f"{f'{ratio:.2f}x' if ratio else '-'} | {target or '-'}x |")
        out.append({"case": [name, batch, dtype], "target": target, **res.to_dict()})
        with open(args.results, "a") as f:
            f.write(f"\n```\n{table}\n{verdict}\n```\n")
        del model
    header = ("\nSummary:\n\n| model | batch | dtype | served | best peer | peer ms | torchkiln ms | speedup | target |\n"
              "|---|---|---|---|---|---|---|---|---|\n")
    with open(args.results, "a") as f:
        f.write(header + "\n".join(summary) + "\n")
    print(header + "\n".join(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


def _all_peers(device, dtype, autotune):
    from torchkiln.bench import peers_for

    return peers_for(device, dtype, autotune=autotune).keys()


if __name__ == "__main__":
    raise SystemExit(main())
