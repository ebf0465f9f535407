"""Does GELU in the FFN GEMM's epilogue pay on CUDA? bert-base bf16 spends ~0.44 ms of a 3.2 ms
bs64 call in a separate GELU kernel that reads and writes the 4x-wide activation again (H200
profile, RESULTS.md). cuBLASLt can apply bias + GELU in the GEMM epilogue
(``torch._addmm_activation(..., use_gelu=True)``; on CUDA its GELU is the tanh approximation,
at most ~5e-4 from the exact one, below bf16's rounding). Inductor decomposes that op, so it is
wrapped in a custom op, substituted for gelu(linear(x, w, b)) by a pre-grad graph pass. Times
torchkiln's recipe with and without it against stock compile, interleaved in one process.

    python benchmarks/diag_gelu_epilogue.py --device cuda --batch 64 1
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import torchkiln as tk
from torchkiln import inputs, stock, zoo
from torchkiln.candidates import KilnBuild
from torchkiln.passes.compile import compile_model
from torchkiln.plan import plan
from torchkiln.timing import interleaved


@torch.library.custom_op("torchkiln_diag::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch._addmm_activation(b, x.reshape(-1, x.shape[-1]), w.t(), use_gelu=True)
    return out.view(*x.shape[:-1], w.shape[0])


@linear_gelu.register_fake
def _(x, w, b):
    return x.new_empty(*x.shape[:-1], w.shape[0])


GELU = (torch._C._nn.gelu, F.gelu)
LINEAR = (torch._C._nn.linear, F.linear)


class Fuse:
    def __init__(self):
        self.fused = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        for g in list(graph.nodes):
            if g.op != "call_function" or g.target not in GELU or g.args[1:] or g.kwargs.get("approximate", "none") not in ("none", "tanh"):
                continue
            lin = g.args[0]
            if not (isinstance(lin, torch.fx.Node) and lin.op == "call_function" and lin.target in LINEAR
                    and len(lin.users) == 1 and len(lin.args) == 3 and lin.args[2] is not None and not lin.kwargs):
                continue
            with graph.inserting_before(g):
                new = graph.call_function(torch.ops.torchkiln_diag.linear_gelu.default, tuple(lin.args))
            new.meta.update(g.meta)
            g.replace_all_uses_with(new)
            graph.erase_node(g)
            graph.erase_node(lin)
            self.fused += 1


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
        fns, fuses = {}, {}
        for g in ((False, True) if batch > 8 else (True,)) if graphs else (False,):
            for epi in (False, True):
                o = {**opts, "triton.cudagraphs": g} if graphs else dict(opts)
                if epi:
                    fuses[g] = o["pre_grad_custom_pass"] = Fuse()
                build = KilnBuild(model, recipe, (args, kwargs), False, [])
                fns[f"kiln{' + gelu epilogue' if epi else ''}{' + graphs' if g else ''}"] = build.call(
                    compile_model(build.runner(), o, private=True), g)
        for r in stock.compile_recipes(dev, torch.bfloat16):
            if r.how == "cast" and (r.cuda_graphs or batch > 8):
                fns[r.name] = stock.build(r, model, dev)
        fns["eager bf16-cast"] = stock.build(stock.eager_recipes(torch.bfloat16)[0], model, dev)
        calls = {}
        with torch.no_grad():
            ref = model(*args, **kwargs)[0].float()
            for n, f in fns.items():
                for _ in range(3):
                    out = f(*args, **kwargs)
                err = ((out[0].float() - ref).norm() / ref.norm()).item()
                print(f"{n:36s} built, rel err vs float32 {err:.2e}", flush=True)
                calls[n] = (lambda f=f, args=args, kwargs=kwargs: f(*args, **kwargs))
            print("linears fused:", {k: v.fused for k, v in fuses.items()})
            times = interleaved(calls, dev, a.budget, min_rounds=5, prune=100)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        best = min(med.values())
        print(f"\n{a.model} bs{batch} bf16")
        for n, m in sorted(med.items(), key=lambda kv: kv[1]):
            print(f"  {n:36s} {m:8.3f} ms  {m / best:5.2f}x best  ({len(times[n])} rounds)")


if __name__ == "__main__":
    main()
