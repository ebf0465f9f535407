"""Calls through tk.optimize's model that need autograd: a frozen feature network in a perceptual loss.

The optimized forms run without autograd, so such calls run the original: in float32, or under
autocast at the precision asked for where that candidate passed the guard and timed faster than the
float32 model (optimize.py ``_grad_run``). This times one loss-and-backward step through each peer,
interleaved, and prints the ratios and the gradient's error against float32:

    python benchmarks/grad_calls.py [--rounds 9] [--batch 2] [--size 128]

Peers: the feature net as given (float32 eager), the same under bf16 autocast (what a user's AMP
would run), and tk.optimize(net, dtype=bfloat16)'s model.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

import torchkiln as tk


def features() -> nn.Module:
    """VGG-16's first three stages at their widths (the usual perceptual-loss trunk), random weights."""
    def block(i, o):
        return [nn.Conv2d(i, o, 3, padding=1), nn.ReLU()]

    net = nn.Sequential(*block(3, 64), *block(64, 64), nn.MaxPool2d(2), *block(64, 128), *block(128, 128),
                        nn.MaxPool2d(2), *block(128, 256), *block(256, 256), *block(256, 256)).eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=128)
    a = ap.parse_args()
    torch.manual_seed(0)
    net, gen = features(), nn.Conv2d(3, 3, 3, padding=1)
    x = torch.randn(a.batch, 3, a.size, a.size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(net, dtype=torch.bfloat16, sample_input=x)
        with torch.no_grad():
            fast(x)

    def amp(z):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return net(z).float()

    peers = {"float32 eager": net, "bf16 autocast eager": amp, "torchkiln": fast}

    def step(f):
        gen.zero_grad()
        out = gen(x)
        ((out - x).pow(2).mean() + f(out).float().pow(2).mean()).backward()
        return gen.weight.grad.clone()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = {n: step(f) for n, f in peers.items()}  # also the warm-up
        times = {n: [] for n in peers}
        for _ in range(a.rounds):
            for n, f in peers.items():
                t = time.perf_counter()
                step(f)
                times[n].append(time.perf_counter() - t)
    base = statistics.median(times["float32 eager"])
    ref = grads["float32 eager"]
    print(f"perceptual-loss step, features {a.batch}x3x{a.size}x{a.size}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {a.rounds} interleaved rounds")
    print("| peer | ms per step | x float32 eager | generator grad rel err vs float32 |")
    print("|---|---|---|---|")
    for n in peers:
        m = statistics.median(times[n])
        err = ((grads[n] - ref).norm() / ref.norm()).item()
        print(f"| {n} | {m * 1e3:.1f} | {base / m:.2f}x | {err:.2e} |")
    print("torchkiln ran:", next((f.to for f in fast.kiln_report.fallbacks if "require grad" in f.step), "?"))


if __name__ == "__main__":
    main()
