"""What GPTQ (quantization/gptq.py) costs per layer, at Llama-3-8B's shapes: seconds to collect H over
``--rows`` calibration rows and to solve one layer, int4 groups of 128, on ``--device``.

    python benchmarks/gptq_cost.py --device cuda
"""

import argparse
import time

import torch

from torchkiln.quantization import gptq
from torchkiln.quantization.weight_only import int4_grid

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=4096)
    a = ap.parse_args()
    dev = torch.device(a.device)
    print("| layer (N x K) | H over rows, s | solve, s | x per Llama-3-8B (32 layers) |")
    print("|---|---|---|---|")
    total = 0.0
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        x = torch.randn(a.rows, k, device=dev, dtype=torch.bfloat16)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        h = torch.zeros(k, k, device=dev)
        h.addmm_(x.float().T, x.float())
        h /= a.rows
        sync()
        th = time.perf_counter() - t
        scale, lo = int4_grid(w, 128)
        t = time.perf_counter()
        gptq.int4(w, h, scale, lo, 128)
        sync()
        ts = time.perf_counter() - t
        total += 32 * (th + ts)
        print(f"| {name} {n}x{k} | {th:.2f} | {ts:.2f} | {32 * (th + ts):.0f} s |", flush=True)
    print(f"\nall layers of a Llama-3-8B-shaped model: ~{total / 60:.1f} min on {dev.type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
