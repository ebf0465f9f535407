"""A model whose weights are already bf16 (a checkpoint loaded in bf16) through tk.optimize: what serves,
the guard's error and tolerance, and the speedup the report measured. Before 77f27d5 every compiled
candidate failed (tolerance 1e-3 against bf16 eager's own rounding) and eager served.

    python benchmarks/diag_half_model.py --device cuda --cases bert-base:1,bert-base:64
"""

import argparse
import warnings

import torch

import torchkiln as tk
from torchkiln import zoo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", default="bert-base:1")
    ap.add_argument("--budget", type=float, default=2.0)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    for case in a.cases.split(","):
        name, batch = case.split(":")
        model, x = zoo.load(name, batch=int(batch))
        model = model.to(a.device, torch.bfloat16)
        x = {k: v.to(a.device) for k, v in x.items()} if isinstance(x, dict) else x.to(a.device, torch.bfloat16)
        fast = tk.optimize(model, sample_input=x, time_budget=a.budget)
        rep = fast.kiln_report
        print(f"{case} bf16 weights on {a.device}: serving {rep.active!r}; error {rep.error}, tolerance "
              f"{rep.tolerance:.3g}; speedup {rep.speedup}", flush=True)
        for m in rep.candidates:
            print(f"   {m.name:45s} {m.status:8s} {m.median_ms if m.median_ms is not None else '-'} {m.reason[:80]}")


if __name__ == "__main__":
    main()
