"""Which inductor options make a compiled conv net (resnet50 bf16) faster on CUDA?

#6's resnet50 bs256 target (27,000 img/s on the H200) was missed by 1-4%. Its convolutions take
~7.5 of 9.1 ms (profile_gpu.py), and inductor runs each conv's bias/ReLU/residual as a separate
Triton kernel. Most of resnet50's convolutions are 1x1: in channels_last a 1x1 conv is a GEMM with a
small K, memory-bound, so a separate epilogue pass over its output costs about as much as the conv.
This script times torchkiln's recipe with inductor options that change that, against the stock
peers, interleaved in one process:

- ``conv_1x1_as_mm``: 1x1 convs become matmuls (cuBLAS), so inductor may fuse around them;
- ``+ max_autotune_gemm``: those matmuls may also be Triton templates with the epilogue inside;
- ``+ max_autotune``: inductor's Triton conv templates too (long to compile);
- cuDNN's ``benchmark_limit=0``: try every algorithm cuDNN offers, not its heuristic's first 10;
- ``coordinate_descent_tuning``: inductor tunes the block sizes of its own (epilogue) kernels.

The first four are ``--tried`` (H200, 2026-11-24: all 3-6% slower than the plan, RESULTS.md).

    python benchmarks/diag_conv_options.py --device cuda --batch 256 --budget 10 [--tried]
"""

from __future__ import annotations

import sys

import torch
from _variants import cases, check_and_time, print_table

from torchkiln import stock
from torchkiln.candidates import KilnBuild
from torchkiln.passes.compile import compile_model

TRIED = {
    "kiln conv1x1-mm": {"conv_1x1_as_mm": True},
    "kiln conv1x1-mm autotune-gemm": {"conv_1x1_as_mm": True, "max_autotune_gemm": True,
                                      "max_autotune_gemm_backends": "ATEN,TRITON"},
    "kiln autotune-gemm": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"},
    "kiln conv1x1-mm max-autotune": {"conv_1x1_as_mm": True, "max_autotune": True},
}
# name -> (inductor options over the recipe's, cuDNN benchmark_limit)
VARIANTS = {
    "kiln as planned": ({}, 10),
    "kiln cudnn-all-algos": ({}, 0),
    "kiln coordesc": ({"coordinate_descent_tuning": True}, 10),
    "kiln cudnn-all-algos coordesc": ({"coordinate_descent_tuning": True}, 0),
}


def _limited(build: KilnBuild, limit: int) -> None:
    """The build's calls run under cuDNN flags with this benchmark_limit (torchkiln's keep torch's 10)."""
    c = torch.backends.cudnn
    build._flags = lambda: c.flags(enabled=c.enabled, benchmark=True, benchmark_limit=limit,
                                   deterministic=c.deterministic, allow_tf32=c.allow_tf32)


def main():
    tried = "--tried" in sys.argv
    if tried:
        sys.argv.remove("--tried")
    variants = {"kiln as planned": ({}, 10), **{n: (o, 10) for n, o in TRIED.items()}} if tried else VARIANTS
    for a, dev, batch, model, args, kwargs, recipe in cases("resnet50", 256, 10.0):
        sample = (args, kwargs)
        fns = {}
        for name, (extra, limit) in variants.items():
            if dev.type != "cuda" and (limit != 10 or any(k.startswith("max_autotune") for k in extra)):
                continue  # the Triton templates and cuDNN are CUDA's
            build = KilnBuild(model, recipe, sample, False, [])
            if limit != 10:
                _limited(build, limit)
            o = {**dict(recipe.compile_options), **extra}
            graphs = bool(o.get("triton.cudagraphs"))
            fns[name] = build.call(compile_model(build.runner(), o, private=True), graphs)
            print(f"{name}: options {extra}, cuDNN benchmark_limit {limit}", flush=True)
        for r in stock.compile_recipes(dev, torch.bfloat16):
            if r.how == "cast":
                fns[r.name] = stock.build(r, model, dev, cudnn_benchmark=True)
        _, times, med = check_and_time(fns, model, args, kwargs, dev, a.budget)
        print_table(f"{a.model} bs{batch} bf16 on {dev.type}", times, med, batch)


if __name__ == "__main__":
    main()
