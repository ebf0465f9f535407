"""What tk.optimize leaves resident on the GPU, against the stock reduce-overhead recipe.

    python benchmarks/diag_memory.py --case bert-base:64:bfloat16

For each peer (stock: a bf16 copy of the model; torchkiln: the model itself, which it never
changes, so its own copies are what is counted): the CUDA allocator's peak while building
(tk.optimize's verification and timing included) and its first calls, then, after the
builder's temporaries are gone (gc), what stays allocated and what a served call peaks
at. Deltas over what was allocated before the peer was built. MB = 2**20 bytes.
"""

from __future__ import annotations

import argparse
import copy
import gc

import torch

import torchkiln as tk
from torchkiln import inputs, zoo
from torchkiln.passes import compile_model


def mb(n: int) -> str:
    return f"{n / 2**20:8.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="bert-base:64:bfloat16")
    ap.add_argument("--trace", type=int, default=0, help="referrer levels to print for leftover tensors")
    a = ap.parse_args()
    name, batch, dtype = a.case.split(":")
    low = getattr(torch, dtype)
    model, x = zoo.load(name, batch=int(batch))
    model = model.cuda().eval()
    args, kwargs = inputs.to(inputs.normalize(x), "cuda")
    la, lk = inputs.to((args, kwargs), dtype=low)

    def kiln():  # the user's model is not copied: tk.optimize never changes it (what it adds is counted)
        m = tk.optimize(model, dtype=low, sample_input=args if args else kwargs)
        return m, (lambda: m(*args, **kwargs))

    def stock():
        m = compile_model(copy.deepcopy(model).to(low), {"triton.cudagraphs": True})

        def call():
            torch.compiler.cudagraph_mark_step_begin()
            return m(*la, **lk)
        return m, call

    print(f"{a.case}: model as given {mb(sum(p.numel() * p.element_size() for p in model.parameters()))} MB")
    print("peer                          peak building   resident   peak per call   reserved")
    for label, make in (("stock reduce-overhead", stock), ("torchkiln", kiln)):
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            m, call = make()
            for _ in range(4):
                call()
        torch.cuda.synchronize()
        building = torch.cuda.max_memory_allocated() - base
        gc.collect()
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            call()
        torch.cuda.synchronize()
        per_call = torch.cuda.max_memory_allocated() - base
        print(f"{label:28s} {mb(building)}   {mb(resident)}   {mb(per_call)}   {mb(torch.cuda.memory_reserved())}")
        if label == "torchkiln":
            print(m.kiln_report)
        del m, call
        for _ in range(3):
            gc.collect()
        torch.cuda.synchronize()
        print(f"  after del: {mb(torch.cuda.memory_allocated() - base)} MB still allocated")
        leftovers(a.trace)


def leftovers(trace: int) -> None:
    """The largest CUDA tensors still reachable, and what holds them (--trace levels up)."""
    import types

    found = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().nbytes() > 2**20:
                found.append(o)
        except Exception:  # noqa: BLE001, S112 (fake or opaque tensors)
            continue
    found.sort(key=lambda t: -t.untyped_storage().nbytes())
    print(f"  {len(found)} CUDA tensors over 1 MB reachable, "
          f"{sum(t.untyped_storage().nbytes() for t in found) / 2**20:.0f} MB")
    skip = {id(found)}
    for t in found[:trace and 3]:
        print(f"   {tuple(t.shape)} {t.dtype} {type(t).__name__}")
        obj = t
        for depth in range(trace):
            refs = [r for r in gc.get_referrers(obj) if id(r) not in skip and not isinstance(r, types.FrameType)
                    and r is not found and type(r).__name__ != "list_iterator"]
            skip.add(id(refs))
            if not refs:
                break
            desc = [type(r).__name__ + (str(list(r)[:4]) if isinstance(r, dict) else "") for r in refs[:3]]
            print("   " + "  " * depth + " <- " + "; ".join(d[:150] for d in desc))
            obj = refs[0]


if __name__ == "__main__":
    main()
