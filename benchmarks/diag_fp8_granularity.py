"""fp8 on bert-base bf16 (CUDA): which activation-scale granularity, and which layers, make fp8
pay off. #8 measured tk.quantize's fp8 (torchao, per-row scales, every linear) at 0.37x torchkiln
bf16 on the H200 at bs64: the per-row activation scaling kernels cost more than the fp8 GEMMs save.

    python benchmarks/diag_fp8_granularity.py --batch 64 --rounds 5

Variants, each torchao ``quantize_`` on a copy of the bf16 model, then ``torch.compile``: per-row or
per-tensor scales, on every linear or on the FFN linears only (the two widest GEMMs of a layer).
Prints the relative L2 error against the bf16 model, wall ms per call (interleaved rounds, CUDA
synchronised, medians), and kernel ms per call with the top kernels of each fp8 variant."""

import argparse
import copy
import statistics
import time
import warnings

import torch
from quantization import top_kernels

from torchkiln.zoo import load

warnings.filterwarnings("ignore")


def ffn_only(module, fqn):
    return isinstance(module, torch.nn.Linear) and (".intermediate." in fqn or fqn.endswith("output.dense")
                                                    and ".attention." not in fqn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
    from torchao.quantization.granularity import PerRow, PerTensor

    dev = torch.device("cuda")
    model, x = load("bert-base", batch=a.batch)
    model = model.to(dev).to(torch.bfloat16).eval()
    x = {k: v.to(dev) for k, v in x.items()}

    def fp8(gran, filter_fn=None):
        def build():
            q = copy.deepcopy(model)
            quantize_(q, Float8DynamicActivationFloat8WeightConfig(granularity=gran()), filter_fn=filter_fn)
            return torch.compile(q)
        return build

    builds = {"bf16 compile": lambda: torch.compile(model),
              "fp8 per-row, all": fp8(PerRow), "fp8 per-tensor, all": fp8(PerTensor),
              "fp8 per-row, FFN": fp8(PerRow, ffn_only), "fp8 per-tensor, FFN": fp8(PerTensor, ffn_only)}
    fns, wall = {}, {}
    with torch.no_grad():
        ref = model(**x).last_hidden_state.float()
        for name, build in builds.items():
            try:
                m = build()
                for _ in range(3):
                    out = m(**x)
                err = float((out.last_hidden_state.float() - ref).norm() / ref.norm())
                fns[name] = lambda m=m: m(**x)
                print(f"{name}: rel L2 vs bf16 eager {err:.4f}")
            except Exception as e:  # noqa: BLE001
                print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
        wall = {name: [] for name in fns}
        for _ in range(a.rounds):
            for name, f in fns.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(a.iters):
                    f()
                torch.cuda.synchronize()
                wall[name].append((time.perf_counter() - t) / a.iters * 1e3)
    base = statistics.median(wall["bf16 compile"])
    print(f"\nbert-base bs{a.batch} seq128 on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| variant | wall ms | x bf16 compile |\n|---|---|---|")
    for name in fns:
        print(f"| {name} | {statistics.median(wall[name]):.3f} | {base / statistics.median(wall[name]):.2f}x |")
    for name, f in fns.items():
        top_kernels(name, f, top=6)


if __name__ == "__main__":
    main()
