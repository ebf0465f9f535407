"""The optimizer step alone, on a ~110M-parameter set of bert-base-shaped tensors:
torch's steps against the ones torchkiln uses, interleaved in one process, plus
the DRAM-bandwidth floor measured in the same run.

    python benchmarks/train_optim.py

AdamW: torch's default (on CPU the per-tensor loop), foreach, and fused (what
tk.optimize switches an AdamW to). Lamb and Lars: tk.optim (multi-tensor)
against a straightforward per-parameter loop written from the papers.
Floor: AdamW reads param, grad, exp_avg, exp_avg_sq and writes three of them,
28 bytes per fp32 parameter; divided by the copy bandwidth (bytes read +
written per second by a large tensor copy) measured here.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import torch

import torchkiln as tk
from torchkiln.timing import interleaved, median_seconds


def shapes(layers: int = 12, d: int = 768, ff: int = 3072, vocab: int = 30522):
    out = [(vocab, d), (512, d), (d,), (d,)]
    for _ in range(layers):
        out += [(d, d), (d,)] * 4 + [(ff, d), (ff,), (d, ff), (d,)] + [(d,)] * 4
    return out


def param_set(grads):
    ps = [torch.nn.Parameter(torch.randn(g.shape) * 0.02) for g in grads]
    for p, g in zip(ps, grads, strict=True):
        p.grad = g  # shared: every optimizer reads the same gradients
    return ps


class LoopLamb:
    """LAMB as a straightforward per-parameter loop (You et al. 2019, Algorithm 2)."""

    def __init__(self, params, lr=1e-3, b1=0.9, b2=0.999, eps=1e-6, wd=0.01):
        self.params, self.lr, self.b1, self.b2, self.eps, self.wd, self.t = params, lr, b1, b2, eps, wd, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        self.t += 1
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            g = p.grad
            m.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            u = (m / (1 - self.b1 ** self.t)) / ((v / (1 - self.b2 ** self.t)).sqrt() + self.eps) + self.wd * p
            wn, un = p.norm(), u.norm()
            trust = wn / un if wn > 0 and un > 0 else 1.0
            p.sub_(self.lr * trust * u)


class LoopLars:
    """LARS as a per-parameter loop (You et al. 2017), timm's variant (as tk.optim.Lars)."""

    def __init__(self, params, lr=0.1, momentum=0.9, wd=1e-4, eta=1e-3):
        self.params, self.lr, self.mom, self.wd, self.eta = params, lr, momentum, wd, eta
        self.buf = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        for p, b in zip(self.params, self.buf, strict=True):
            g = p.grad
            wn, gn = p.norm(), g.norm()
            trust = self.eta * wn / (gn + self.wd * wn + 1e-9) if wn > 0 and gn > 0 else 1.0
            b.mul_(self.mom).add_((g + self.wd * p) * trust)
            p.sub_(self.lr * b)


def copy_bandwidth(n: int) -> float:
    a, b = torch.randn(n), torch.empty(n)
    return 2 * a.numel() * a.element_size() / median_seconds(lambda: b.copy_(a), warmup=2, iters=7)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=40.0)
    a = ap.parse_args()
    torch.manual_seed(0)
    grads = [torch.randn(s) * 1e-3 for s in shapes()]
    n = sum(g.numel() for g in grads)
    opts = {
        "AdamW torch default": torch.optim.AdamW(param_set(grads), lr=1e-4, weight_decay=0.01),
        "AdamW foreach": torch.optim.AdamW(param_set(grads), lr=1e-4, weight_decay=0.01, foreach=True),
        "AdamW fused (torchkiln)": torch.optim.AdamW(param_set(grads), lr=1e-4, weight_decay=0.01, fused=True),
        "Lamb per-parameter loop": LoopLamb(param_set(grads)),
        "Lamb tk.optim": tk.optim.Lamb(param_set(grads), lr=1e-3, weight_decay=0.01),
        "Lars per-parameter loop": LoopLars(param_set(grads)),
        "Lars tk.optim": tk.optim.Lars(param_set(grads), lr=0.1, momentum=0.9, weight_decay=1e-4),
    }
    steps = {k: o.step for k, o in opts.items()}
    for s in steps.values():
        s()  # state allocation outside the clock
    bw = copy_bandwidth(64 * 2 ** 20)
    times = interleaved(steps, torch.device("cpu"), a.budget, min_rounds=5, prune=100)
    bw2 = copy_bandwidth(64 * 2 ** 20)
    med = {k: statistics.median(t) for k, t in times.items()}
    floor = 28 * n / max(bw, bw2)
    print(f"\n### {datetime.date.today()} optimizer step, {n / 1e6:.0f}M fp32 parameters ({len(grads)} tensors), "
          f"CPU {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print(f"Command: `python {' '.join(sys.argv)}` (medians of {min(len(t) for t in times.values())}+ interleaved "
          f"rounds; copy bandwidth {bw / 1e9:.1f} / {bw2 / 1e9:.1f} GB/s before / after, read+written)\n")
    print("| step | ms | vs baseline | % of DRAM floor |\n|---|---|---|---|")
    base = {"AdamW": med["AdamW torch default"], "Lamb": med["Lamb per-parameter loop"],
            "Lars": med["Lars per-parameter loop"]}
    for k, m in med.items():
        fam = k.split()[0]
        pct = f"{floor / m:.0%}" if fam == "AdamW" else "-"
        print(f"| {k} | {1e3 * m:.1f} | {base[fam] / m:.2f}x | {pct} |")
    print(f"\nAdamW floor: 28 B/param x {n / 1e6:.0f}M / {max(bw, bw2) / 1e9:.1f} GB/s = {1e3 * floor:.1f} ms; "
          f"fused vs foreach {med['AdamW foreach'] / med['AdamW fused (torchkiln)']:.2f}x")


if __name__ == "__main__":
    main()
