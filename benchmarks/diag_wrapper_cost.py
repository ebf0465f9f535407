"""What the returned model adds to a call on the CPU, piece by piece: the model itself, the served
callable, the served callable behind ``_serve``, the class's ``forward`` (the checks), the instance
``forward`` (closed to torch.compile) and the full call. us per call, second-best of 7 repeats.

    python benchmarks/diag_wrapper_cost.py [--model lin|mlp]

lin: an 8x8 Linear at one row (the wrapper dominates); mlp: 256-512-256 with GELU at one row.
"""

from __future__ import annotations

import argparse
import timeit

import torch
from torch import nn

import torchkiln as tk


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["lin", "mlp"], default="lin")
    p.add_argument("-n", type=int, default=20000)
    a = p.parse_args()
    torch.manual_seed(0)
    if a.model == "lin":
        m, x = nn.Linear(8, 8).eval(), torch.randn(1, 8)
    else:
        m, x = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).eval(), torch.randn(1, 256)
    fast = tk.optimize(m, sample_input=(x,), progress=False)
    torch.set_grad_enabled(False)
    fast(x)
    fn, fwd, cls = fast._fn, fast.forward, type(fast)
    pieces = {"model": lambda: m(x), "served fn": lambda: fn(x), "_serve": lambda: fast._serve(fn, (x,), {}),
              "class forward": lambda: cls.forward(fast, x), "instance forward": lambda: fwd(x),
              "returned model": lambda: fast(x)}
    print(f"{a.model}: serving {tk.report(fast).active}")
    for name, f in pieces.items():
        us = sorted(timeit.repeat(f, number=a.n, repeat=7))[1] / a.n * 1e6
        print(f"{name:18s} {us:7.2f} us")


if __name__ == "__main__":
    main()
