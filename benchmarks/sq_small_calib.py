"""SmoothQuant alpha="auto" on small calibration sets: held-out SQNR of an MLP 64-128-128-16 (Gaussian
inputs, 128 new rows) calibrated on 32 / 256 / 1024 rows, int8-static against int8-smoothquant, with the
alphas chosen per linear (None: not smoothed). Accuracy only, no timing.

    python benchmarks/sq_small_calib.py
"""

import warnings

import torch
from torch import nn

import torchkiln as tk


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-30)))


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16)).eval()
    g = torch.Generator().manual_seed(9)
    held = torch.randn(128, 64, generator=g)
    with torch.no_grad():
        ref = m(held)
    print("| calibration rows | int8-static | int8-smoothquant (alphas) |\n|---|---|---|")
    for rows in (32, 256, 1024):
        calib = [torch.randn(8, 64, generator=g) for _ in range(rows // 8)]
        got = {}
        for scheme in ("int8-static", "int8-smoothquant"):
            q = tk.quantize(m, scheme, calib_data=calib, progress=False, auto_fallback=False)
            with torch.no_grad():
                got[scheme] = (sqnr(ref, q(held)), list(getattr(q.kiln_quant, "alphas", {}).values()))
        print(f"| {rows} | {got['int8-static'][0]:.1f} dB | {got['int8-smoothquant'][0]:.1f} dB "
              f"{got['int8-smoothquant'][1]} |")


if __name__ == "__main__":
    main()
