"""Does padding resnet50's 3-channel stem convolution to 4 or 8 input channels make it faster on CUDA?

#6's resnet50 bf16 bs256 target (27,000 img/s on the H200) was missed by 1-4%. In channels_last a
convolution whose input has 3 channels cannot use cuDNN's vectorised tensor-core kernels, which want
the channel count a multiple of 8 (16 bytes of bf16); zero channels appended to the input and to
the weight leave the result unchanged (each output adds 0 * 0 terms) and may let cuDNN pick a faster
kernel. This script times torchkiln's recipe (which pads to 8, ``passes/pad_conv_channels.py``), the
recipe without the padding and with padding to 4, against the stock peers, interleaved in one
process, and prints each variant's top kernels.

    python benchmarks/diag_stem_pad.py --device cuda --batch 256 64 --budget 8
"""

from __future__ import annotations

import dataclasses

import torch
from _variants import cases, check_and_time, gpu_kernels, print_table

from torchkiln import stock
from torchkiln.candidates import KilnBuild
from torchkiln.passes import registry
from torchkiln.passes.compile import compile_model


def variant(recipe, multiple: int | None):
    """The recipe with its stem padding to ``multiple`` channels, or without it (None)."""
    passes = [c for c in recipe.passes if c.name != "pad_conv_channels"]
    if multiple:
        passes.append(registry.make("pad_conv_channels", multiple=multiple))
    return dataclasses.replace(recipe, passes=registry.ordered(passes))


def top_kernels(fn, n: int = 8, iters: int = 10) -> None:
    per = gpu_kernels(fn, iters)
    print(f"    GPU {sum(per.values()) / 1e3:.3f} ms per call; top kernels (us per call):")
    for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:n]:
        print(f"    {us:9.1f}  {name[:110]}")


def main():
    for a, dev, batch, model, args, kwargs, recipe in cases("resnet50", 256, 8.0):
        fns = {}
        for name, multiple in [("kiln pad8 (CUDA plan)", 8), ("kiln no pad", None), ("kiln pad4", 4)]:
            r = variant(recipe, multiple)
            build = KilnBuild(model, r, (args, kwargs), False, [])
            o = dict(r.compile_options)
            fns[name] = build.call(compile_model(build.runner(), o, private=True), bool(o.get("triton.cudagraphs")))
        for r in stock.compile_recipes(dev, torch.bfloat16):
            if r.how == "cast":
                fns[r.name] = stock.build(r, model, dev, cudnn_benchmark=True)
        calls, times, med = check_and_time(fns, model, args, kwargs, dev, a.budget)
        print_table(f"{a.model} bs{batch} bf16 on {dev.type}", times, med, batch)
        if dev.type == "cuda":
            with torch.no_grad():
                for name in ("kiln pad8 (CUDA plan)", "kiln no pad", "kiln pad4"):
                    print(f"\n  {name}:")
                    top_kernels(calls[name])


if __name__ == "__main__":
    main()
