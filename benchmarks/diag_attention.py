"""Why is torchkiln's own compiled transformer slower than stock torch.compile?
Times variants of torchkiln's recipe (one change each) against the stock peers,
interleaved in one process, then prints the top kernels of the slowest and the
fastest variant.

    python benchmarks/diag_attention.py --device cuda --batch 64
"""

from __future__ import annotations

import argparse

import torch
from _variants import check_and_time, print_table
from torch.profiler import ProfilerActivity, profile

import torchkiln as tk
from torchkiln import inputs, stock, zoo
from torchkiln.candidates import KilnBuild
from torchkiln.passes.compile import compile_model
from torchkiln.plan import plan


def variants(model, sample, device: str, graphs: bool, autotune: bool, only=()):
    recipe = plan(model, tk.detect(), device, torch.bfloat16, "O1", {}, batch=inputs.batch_size(sample))
    opts = dict(recipe.compile_options)
    opts["triton.cudagraphs"] = graphs and device == "cuda"
    nofreeze = {**opts, "freezing": False}
    mk = {
        "kiln as planned": (recipe, opts),
        "kiln attention=sdpa": (recipe.replace(attention="sdpa"), opts),
        # oneDNN-prepacked linears (CPU) need freezing: drop them with it.
        "kiln freezing off": (recipe.without("onednn_linear"), nofreeze),
        "kiln sdpa + freezing off": (recipe.without("onednn_linear").replace(attention="sdpa"), nofreeze),
        "kiln keep mask": (recipe.replace(drop_all_ones_mask=False), opts),
        "kiln without concat_linear": (recipe.without("concat_linear"), opts),
    }
    if autotune:
        mk["kiln sdpa + max-autotune"] = (recipe.replace(attention="sdpa"), {**opts, "max_autotune": True})
        # Triton GEMM templates can take the bias+GELU epilogue that cuBLAS calls leave to a separate kernel
        mk["kiln max-autotune"] = (recipe, {**opts, "max_autotune": True})
    # The plan's graph, called without the host-side all-ones check of the mask (a device sync per call):
    # what that check costs. Only valid here, where the benchmark's mask is all ones.
    mk["kiln no mask check"] = (recipe.replace(drop_all_ones_mask=False), opts)
    out = {}
    for name, (rec, o) in mk.items():
        if only and name not in only:
            continue
        build = KilnBuild(model, rec, sample, False, [])
        out[name] = build.call(compile_model(build.runner(), o, fullgraph=False, private=True), o["triton.cudagraphs"])
        if name == "kiln no mask check":
            out[name] = _unmasked(out[name])
    dev = torch.device(device)
    low = torch.bfloat16
    for r in stock.eager_recipes(low)[:1] + [r for r in stock.compile_recipes(dev, low, autotune)
                                             if r.how == "cast"]:
        if r.cuda_graphs == graphs or r.compile is False or r.mode == "max-autotune-no-cudagraphs":
            out[r.name] = stock.build(r, model, dev)
    print("recipe:", recipe)
    return out


def _unmasked(call):
    def run(*args, **kwargs):
        return call(*args, **{k: v for k, v in kwargs.items() if k != "attention_mask"})
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--graphs", action="store_true", help="torchkiln variants with CUDA graphs, peers reduce-overhead")
    ap.add_argument("--budget", type=float, default=10.0)
    ap.add_argument("--autotune", action="store_true", help="add max-autotune variants (slow to compile)")
    ap.add_argument("--only", default="", help="comma-separated torchkiln variant names to build (default: all)")
    a = ap.parse_args()
    model, x = zoo.load(a.model, batch=a.batch)
    model = model.to(a.device).eval()
    args, kwargs = inputs.to(inputs.normalize(x), a.device)
    fns = variants(model, (args, kwargs), a.device, a.graphs, a.autotune, [v for v in a.only.split(',') if v])
    calls, times, med = check_and_time(fns, model, args, kwargs, torch.device(a.device), a.budget)
    print_table(f"{a.model} bs{a.batch} bf16 graphs={a.graphs}", times, med)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    slow, fast = max(med, key=med.get), min(med, key=med.get)
    for n in dict.fromkeys((slow, fast, "kiln as planned")):
        with torch.no_grad(), profile(activities=acts) as prof:
            for _ in range(5):
                calls[n]()
            torch.cuda.synchronize() if a.device == "cuda" else None
        key = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
        print(f"\n== {n}: top ops (5 calls)")
        print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=80))


if __name__ == "__main__":
    main()
