"""Does GELU in the FFN GEMM's epilogue pay on CUDA? Times torchkiln's recipe as planned (with the
``gelu_epilogue`` graph pass, passes/gelu_epilogue.py) and without it, with and without CUDA graphs,
against stock compile and eager, interleaved in one process; prints each one's error against the
float32 model.

    python benchmarks/diag_gelu_epilogue.py --device cuda --batch 64 1
"""

from __future__ import annotations

import argparse

import torch
from _variants import check_and_time, print_table

import torchkiln as tk
from torchkiln import inputs, stock, zoo
from torchkiln.candidates import KilnBuild
from torchkiln.passes import registry
from torchkiln.passes.compile import compile_model
from torchkiln.plan import plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--budget", type=float, default=5.0)
    a = ap.parse_args()
    dev = torch.device(a.device)
    for batch in a.batch:
        model, x = zoo.load(a.model, batch=batch)
        model = model.to(dev).eval()
        args, kwargs = inputs.to(inputs.normalize(x), dev)
        recipe = plan(model, tk.detect(), a.device, torch.bfloat16, "O1", {}, batch=batch)
        opts = dict(recipe.compile_options)
        graphs = dev.type == "cuda"
        fns = {}
        for g in ((False, True) if batch > 8 else (True,)) if graphs else (False,):
            for epi in (False, True):
                o = {**opts, "triton.cudagraphs": g} if graphs else dict(opts)
                rec = recipe if epi else recipe.without("gelu_epilogue")
                if registry.graph_pass(rec.passes) is not None:  # as the compiled candidates install it
                    o["pre_grad_custom_pass"] = registry.graph_pass(rec.passes)
                build = KilnBuild(model, rec, (args, kwargs), False, [])
                fns[f"kiln{' + gelu epilogue' if epi else ''}{' + graphs' if g else ''}"] = build.call(
                    compile_model(build.runner(), o, private=True), g)
        for r in stock.compile_recipes(dev, torch.bfloat16):
            if r.how == "cast" and (r.cuda_graphs or batch > 8):
                fns[r.name] = stock.build(r, model, dev)
        fns["eager bf16-cast"] = stock.build(stock.eager_recipes(torch.bfloat16)[0], model, dev)
        _, times, med = check_and_time(fns, model, args, kwargs, dev, a.budget)
        print_table(f"{a.model} bs{batch} bf16", times, med)


if __name__ == "__main__":
    main()
