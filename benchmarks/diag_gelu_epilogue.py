"""Does GELU in the FFN GEMM's epilogue pay on CUDA? Times torchkiln's recipe as planned (with the
``gelu_epilogue`` graph pass, passes/gelu_epilogue.py) and without it, with and without CUDA graphs,
against stock compile and eager, interleaved in one process; prints each one's error against the
float32 model.

    python benchmarks/diag_gelu_epilogue.py --device cuda --batch 64 1
"""

from __future__ import annotations

import torch
from _variants import cases, check_and_time, print_table

from torchkiln import stock
from torchkiln.candidates import KilnBuild
from torchkiln.passes import registry
from torchkiln.passes.compile import compile_model


def main():
    for a, dev, batch, model, args, kwargs, recipe in cases("bert-base", 64, 5.0):
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
