"""Is the candidate selection right for short calls? What it served at the sample, against steady streams.

tk.optimize times its candidates at the sample (``timing.interleaved``). One call of each in turn pays,
at every call, the switch from the form before (0.5-1.2 ms on a 2-core Zen 4), which for calls well
under a millisecond can outweigh the differences being measured; short calls are timed in blocks
instead (``streams``). This script optimizes an MLP (6 x Linear 512 + LayerNorm + GELU) with a
one-row sample, per dtype with and without ``graph_mode=False``, prints each candidate's selection
median, makes 70 calls (a close winner is timed again at the 64th), then times the returned model
against the model as given in long interleaved blocks (200 calls each: the switch is ~1% of a block).

    python benchmarks/diag_selection_short.py [--rows 1] [--rounds 4]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from shape_timing import mlp, steady

import torchkiln as tk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    model, x = mlp(), torch.randn(a.rows, 512)
    print("| dtype | options | served | selection medians, ms | returned / as given, steady |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for opts in ({}, {"graph_mode": False}):
            fast = tk.optimize(model, dtype=dtype, sample_input=x, **opts)
            rep = tk.report(fast)
            sel = ", ".join(f"{m.name} {m.median_ms:.3f}" for m in rep.candidates if m.median_ms)
            with torch.no_grad():
                for _ in range(70):
                    fast(x)
                t = steady({"given": model, "returned": fast}, x, a.rounds)
            served = rep.active + "".join(f" ({s['serves']} after {s['after_calls']} calls)"
                                          for s in rep.shapes if "after_calls" in s and s["serves"] != rep.active)
            print(f"| {str(dtype).removeprefix('torch.')} | {opts or 'default'} | {served} | {sel} | "
                  f"{t['returned'] / t['given']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
