"""How close a served CPU CNN is to this machine's GEMM ceiling: why #11's resnet50
fp32/bf16 target (>= 1.05x IPEX) is a kernel question, not a fusion one.

    python benchmarks/diag_cnn_roofline.py --dtypes float32,bfloat16 --rounds 7

Counts the model's convolution and linear FLOPs (2 x MACs, forward hooks), times
torchkiln's served model, and times one large GEMM per dtype (oneDNN, prepacked
weight) as the ceiling a convolution kernel can reach here. The two are timed
interleaved, one process. Prints GFLOP/s of each and the served model's share of
the ceiling."""

import argparse
import statistics
import time

import torch

import torchkiln as tk
from torchkiln import inputs, zoo


def model_flops(model, x):
    total = [0]

    def hook(mod, inp, out):
        if isinstance(mod, torch.nn.Conv2d):
            k = mod.in_channels // mod.groups * mod.kernel_size[0] * mod.kernel_size[1]
            total[0] += 2 * out.numel() * k
        elif isinstance(mod, torch.nn.Linear):
            total[0] += 2 * out.numel() * mod.in_features

    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    return total[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--gemm", type=int, default=2048, help="square GEMM size for the ceiling")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    model, x = zoo.load(a.model, batch=a.batch)
    flops = model_flops(model, x)
    print(f"{a.model} bs{a.batch}: {flops / 1e9:.2f} GFLOP per call (conv + linear, 2 x MACs); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | served | model ms | model GFLOP/s | GEMM GFLOP/s | model / GEMM |")
    print("|---|---|---|---|---|---|")
    for name in a.dtypes.split(","):
        row(model, x, flops, name, a.gemm, a.rounds)


def row(model, x, flops, name, size, rounds):
    dt = getattr(torch, name)
    served = tk.optimize(model, dtype=dt, sample_input=x)
    args, kw = inputs.normalize(x)
    g = torch.randn(size, size, dtype=dt)
    # oneDNN's GEMM with a prepacked weight, as the convolutions get (torch.mm in float32 is MKL's,
    # 185 GFLOP/s on a Zen 5 where oneDNN reaches ~480)
    h = torch.ops.mkldnn._reorder_linear_weight(torch.randn(size, size, dtype=dt), size)
    fns = {"model": lambda: served(*args, **kw),
           "gemm": lambda: torch.ops.mkldnn._linear_pointwise(g, h, None, "none", [], "")}
    times = {n: [] for n in fns}
    with torch.no_grad():
        for f in fns.values():
            for _ in range(3):
                f()
        for _ in range(rounds):
            for n, f in fns.items():
                t = time.perf_counter()
                for _ in range(3):
                    f()
                times[n].append((time.perf_counter() - t) / 3)
    m, gm = statistics.median(times["model"]), statistics.median(times["gemm"])
    mg, gg = flops / m / 1e9, 2 * size ** 3 / gm / 1e9
    print(f"| {name} | {served.kiln_report.active} | {m * 1e3:.2f} | {mg:.0f} | {gg:.0f} | {mg / gg:.0%} |")

if __name__ == "__main__":
    main()
