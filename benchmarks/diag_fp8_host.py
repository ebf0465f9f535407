"""Where an fp8 bert-base call's time goes on CUDA beyond its kernels: torchao's tensor-subclass
weights at the compiled graph's boundary, and what removes that cost.

    python benchmarks/diag_fp8_host.py --batch 64 --rounds 5

Builds bert-base bf16, tk.quantize(..., "fp8"), then times (interleaved rounds, CUDA-synchronised,
median ms per call): tk.optimize's served model; torch.compile of the quantized model; the same
after torchao's unwrap_tensor_subclass (parameters become plain tensors, the subclass rebuilt
inside the traced graph); that with mode="reduce-overhead"; and torch.compile with freezing.
Prints each one's kernel time per call (torch.profiler) beside its wall time."""

import argparse
import copy
import statistics
import time
import warnings

import torch
from _variants import gpu_us

import torchkiln as tk
from torchkiln.zoo import load

warnings.filterwarnings("ignore")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    from torchao.utils import unwrap_tensor_subclass

    dev = torch.device("cuda")
    model, x = load("bert-base", batch=a.batch)
    model = model.to(dev).to(torch.bfloat16)
    x = {k: v.to(dev) for k, v in x.items()}
    q = tk.quantize(model, "fp8", calib_data=[x], progress=False)
    builds = {"tk.optimize served": lambda: tk.optimize(q, sample_input=x, time_budget=2),
              "compile": lambda: torch.compile(q),
              "unwrap + compile": lambda: torch.compile(unwrap_tensor_subclass(copy.deepcopy(q))),
              "unwrap + reduce-overhead": lambda: torch.compile(unwrap_tensor_subclass(copy.deepcopy(q)),
                                                                mode="reduce-overhead"),
              "bf16 compile reduce-overhead": lambda: torch.compile(model, mode="reduce-overhead")}
    fns, wall, kern = {}, {}, {}
    with torch.no_grad():
        ref = q(**x).last_hidden_state.float()
        for name, build in builds.items():
            try:
                m = build()
                for _ in range(3):
                    out = m(**x)
                err = float((out.last_hidden_state.float() - ref).norm() / ref.norm())
                fns[name] = lambda m=m: m(**x)
                print(f"{name}: built, rel diff to eager fp8 {err:.4f}"
                      + (f", served {m.kiln_report.active}" if hasattr(m, "kiln_report") else ""))
            except Exception as e:  # noqa: BLE001
                print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
        for name in fns:
            wall[name] = []
        for _ in range(a.rounds):
            for name, f in fns.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(a.iters):
                    f()
                torch.cuda.synchronize()
                wall[name].append((time.perf_counter() - t) / a.iters * 1e3)
        for name, f in fns.items():
            kern[name] = gpu_us(f, iters=5) / 1e3
    print(f"\nbert-base bs{a.batch} seq128 fp8 on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| build | wall ms | kernels ms |\n|---|---|---|")
    for name in fns:
        print(f"| {name} | {statistics.median(wall[name]):.3f} | {kern[name]:.3f} |")


if __name__ == "__main__":
    main()
