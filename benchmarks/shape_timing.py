"""Batch sizes other than the sample's: is the served model ever slower there than the model as given?

tk.optimize times its candidates at the sample's shapes. At each of the first new input signatures
the returned model is verified against the model as given and also timed against it, and the model
as given answers that signature where it is faster (``KilnModule._slower_than_given``). This script
optimizes an MLP at one batch size, then times, per batch size, in interleaved rounds in one process:
the model as given (eager), the returned model, the returned model with ``graph_mode=False,
candidates="torchkiln"`` (the eager passes serve: oneDNN linears packed for the sample's rows), and
a copy of that one whose later signatures are neither verified nor timed (``verify="first"`` set on
the copy: what torchkiln did before the per-signature timing; the same selected form).

    python benchmarks/shape_timing.py [--dtype float32] [--sample 64] [--batches 1 8 64 512] [--rounds 15]
                                      [--iters N | --block-ms 60]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch import nn

import torchkiln as tk


def mlp(width: int = 512, depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 10)).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sample", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=0,
                    help="calls per block; 0 (default): as many as fill --block-ms of the model as given")
    ap.add_argument("--block-ms", type=float, default=60.0)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    model = mlp()
    dtype = getattr(torch, a.dtype)
    sample = torch.randn(a.sample, 512)
    fast = tk.optimize(model, dtype=dtype, sample_input=sample)
    # graph_mode=False (IPEX's knob) and candidates="torchkiln": no compiled candidate and no eager one,
    # so the eager passes serve (oneDNN linears packed for the sample's rows), the form the
    # per-signature timing was added for
    passes = tk.optimize(model, dtype=dtype, sample_input=sample, graph_mode=False, candidates="torchkiln")
    before = copy.deepcopy(passes)  # the same decision (deepcopy keeps it) on its own copy of the weights
    before._opts["verify"] = "first"  # private, for this A/B only: no later signature verified or timed
    peers = {"eager (as given)": model, "torchkiln": fast, "torchkiln graph_mode=False": passes,
             "the same, first signature only": before}
    for n in ("torchkiln", "torchkiln graph_mode=False"):
        print(f"{n}: served at the sample ({a.sample} rows): {tk.report(peers[n]).active}")
    rows = []
    with torch.no_grad():
        for b in a.batches:
            x = torch.randn(b, 512)
            for f in peers.values():  # first calls: compiles, verification and the signature's timing
                f(x)
                f(x)
            # Long blocks: the first calls after another peer's pay a switch (0.5-1.2 ms at one row on a
            # 2-core Zen 4; timing.blocks), which 20-call blocks of a 0.4-ms model carried (RESULTS.md,
            # thirty-fifth session).
            iters = a.iters or max(5, int(a.block_ms / 1e3 / min(_one_call(model, x) for _ in range(3))))
            med = steady(peers, x, a.rounds, iters)
            rows.append((b, {n: v * 1e3 for n, v in med.items()},
                         [_serves(peers[n], b) for n in ("torchkiln", "torchkiln graph_mode=False")]))
    print(f"\nMLP 6x512 {a.dtype}, sample {a.sample} rows; median ms per call over {a.rounds} interleaved rounds "
          f"of {a.iters or f'~{a.block_ms:.0f} ms of'} calls; x = eager's time over the peer's\n")
    print("| rows | eager (as given) | torchkiln | x | serves | graph_mode=False | x | serves "
          "| the same, first signature only | x |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, med, (s1, s2) in rows:
        e = med["eager (as given)"]
        k, p, t = med["torchkiln"], med["torchkiln graph_mode=False"], med["the same, first signature only"]
        print(f"| {b} | {e:.3f} | {k:.3f} | {e / k:.2f}x | {s1} | {p:.3f} | {e / p:.2f}x | {s2} | {t:.3f} | {e / t:.2f}x |")
    for n in ("torchkiln", "torchkiln graph_mode=False"):
        print(f"\n{n}:\n{tk.report(peers[n])}")


def streams(peers: dict, x, rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds a call of each peer, one sample per block of ``calls`` consecutive calls, the blocks
    interleaved over ``rounds``."""
    ms: dict[str, list[float]] = {k: [] for k in peers}
    for _ in range(rounds):
        for k, f in peers.items():
            t = time.perf_counter()
            for _ in range(calls):
                f(x)
            ms[k].append((time.perf_counter() - t) / calls)
    return ms


def steady(peers: dict, x, rounds: int, calls: int = 200) -> dict[str, float]:
    """Median seconds a call of each peer (``streams``); long blocks by default, so the switch from one
    form to the other (0.5-1.2 ms at one row on a 2-core Zen 4; timing.blocks) is ~1% of a block."""
    return {k: statistics.median(v) for k, v in streams(peers, x, rounds, calls).items()}


def _one_call(f, x) -> float:
    t = time.perf_counter()
    f(x)
    return time.perf_counter() - t


def _serves(fast, rows: int) -> str:
    """Which form answers calls of ``rows`` rows: the one timed at that signature, else the selected one."""
    return next((s["serves"] for s in tk.report(fast).shapes if s["inputs"] == [[rows, 512]]), tk.report(fast).active)


if __name__ == "__main__":
    main()
