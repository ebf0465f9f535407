"""Which TorchScript serving form runs resnet50 fastest on this CPU (#11), interleaved in one process.

    python benchmarks/diag_cnn_forms.py --dtypes float32,bfloat16 --batch 1 --rounds 8 --iters 10

Forms, each a frozen trace of the same model (BatchNorm folded by freezing):
- llga:        torch's oneDNN Graph fuser (what torchkiln's "oneDNN graph" candidate serves)
- llga-cl:     the same, model and input in channels_last
- mkldnn:      torch.jit.optimize_for_inference (stock MKLDNN conversion: prepacked conv weights,
               fused ReLU/add, activations kept in oneDNN's blocked layout between convolutions)
- mkldnn-cl:   the same with a channels_last input
- compile:     torch.compile with freezing (the stock recipe)
Prints per-form median ms and each form's ratio to llga.
"""

import argparse
import statistics
import time

import torch

from torchkiln import zoo


def frozen(model, x):
    with torch.no_grad():
        return torch.jit.freeze(torch.jit.trace(model, (x,), check_trace=False).eval())


def llga(model, x):
    f = frozen(model, x)
    prev = torch._C._jit_llga_enabled()
    torch._C._jit_set_llga_enabled(True)
    try:
        with torch.no_grad():
            for _ in range(4):
                f(x)
    finally:
        torch._C._jit_set_llga_enabled(prev)
    return f


def mkldnn(model, x):
    with torch.no_grad():
        f = torch.jit.optimize_for_inference(torch.jit.trace(model, (x,), check_trace=False).eval())
        for _ in range(3):
            f(x)
    return f


def compiled(model, x):
    import torch._inductor.config as cfg

    cfg.freezing = True
    f = torch.compile(model)
    with torch.no_grad():
        for _ in range(3):
            f(x)
    return f


def build(form, dtype, batch):
    model, x = zoo.load("resnet50", batch=batch)
    model = model.eval()
    with torch.no_grad():
        ref = model(x)
    model = model.to(dtype)
    x = x.to(dtype)
    if form.endswith("-cl"):
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    base = form.removesuffix("-cl")
    fn = {"llga": llga, "mkldnn": mkldnn, "compile": compiled}[base](model, x)
    return fn, x, ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--forms", default="llga,llga-cl,mkldnn,mkldnn-cl,compile")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for dtype in a.dtypes.split(","):
        dt = getattr(torch, dtype)
        built = {}
        for form in a.forms.split(","):
            try:
                built[form] = build(form, dt, a.batch)
            except Exception as e:  # a form this torch cannot build: say so, go on
                print(f"{dtype} {form}: failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
        times = {f: [] for f in built}
        with torch.no_grad():
            for r in range(a.rounds):
                order = list(built)[r % len(built):] + list(built)[:r % len(built)]
                for f in order:
                    fn, x, _ = built[f]
                    ts = []
                    for _ in range(a.iters):
                        t = time.perf_counter()
                        fn(x)
                        ts.append(time.perf_counter() - t)
                    times[f].append(statistics.median(ts) * 1e3)
        base = statistics.median(times["llga"]) if "llga" in times else None
        print(f"\n| {dtype} bs{a.batch} form | median ms | x llga | max rel err vs fp32 eager |\n|---|---|---|---|")
        for f, ts in times.items():
            fn, x, ref = built[f]
            with torch.no_grad():
                out = fn(x).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            med = statistics.median(ts)
            print(f"| {f} | {med:.2f} | {base / med if base else float('nan'):.3f} | {err:.2g} |")


if __name__ == "__main__":
    main()
