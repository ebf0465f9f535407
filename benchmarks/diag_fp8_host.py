"""Where an fp8 bert-base call's time goes on CUDA beyond its kernels: torchao's tensor-subclass
weights at the compiled graph's boundary, and what removes that cost.

    python benchmarks/diag_fp8_host.py --batch 64 --rounds 5

Builds bert-base bf16, tk.quantize(..., "fp8"), then times (interleaved rounds, CUDA-synchronised,
median ms per call): tk.optimize's served model; torch.compile of the quantized model; the same
after torchao's unwrap_tensor_subclass (parameters become plain tensors, the subclass rebuilt
inside the traced graph); that with mode="reduce-overhead"; and torch.compile with freezing.
Prints each one's kernel time per call (torch.profiler) beside its wall time."""

import copy
import warnings

import torch
from _variants import bert_bf16_cuda, build_bert, fp8_args, gpu_us, synced_ms

import torchkiln as tk

warnings.filterwarnings("ignore")


def main():
    a = fp8_args(__doc__)
    from torchao.utils import unwrap_tensor_subclass

    model, x = bert_bf16_cuda(a.batch)
    q = tk.quantize(model, "fp8", calib_data=[x], progress=False)
    builds = {"tk.optimize served": lambda: tk.optimize(q, sample_input=x, time_budget=2),
              "compile": lambda: torch.compile(q),
              "unwrap + compile": lambda: torch.compile(unwrap_tensor_subclass(copy.deepcopy(q))),
              "unwrap + reduce-overhead": lambda: torch.compile(unwrap_tensor_subclass(copy.deepcopy(q)),
                                                                mode="reduce-overhead"),
              "bf16 compile reduce-overhead": lambda: torch.compile(model, mode="reduce-overhead")}
    kern = {}
    fns = build_bert(builds, q, x, "eager fp8")
    with torch.no_grad():
        wall = synced_ms(fns, a.rounds, a.iters)
        for name, f in fns.items():
            kern[name] = gpu_us(f, iters=5) / 1e3
    print(f"\nbert-base bs{a.batch} seq128 fp8 on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| build | wall ms | kernels ms |\n|---|---|---|")
    for name in fns:
        print(f"| {name} | {wall[name]:.3f} | {kern[name]:.3f} |")


if __name__ == "__main__":
    main()
