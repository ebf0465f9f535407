"""A checkpoint loaded in float16 or bfloat16 (``from_pretrained(torch_dtype=...)``) on the CPU: tk.optimize
against the stock ways a user serves it, in one process, interleaved.

    python benchmarks/half_models_cpu.py --model bert-base --dtype float16 [--batch 1] [--rounds 7]

Peers: the model as given (eager, in its dtype); torch.compile with freezing on it; and what a skilled
user does on a CPU that only emulates that dtype, torch.compile with freezing on a float32 copy
(``model.float()``, outputs cast back). Each round times every peer once (a few calls each, medians);
the table gives the median of the rounds and the ratio of each peer to torchkiln.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

import torchkiln as tk
from torchkiln import inputs, zoo
from torchkiln.hardware import detect
from torchkiln.passes.compile import compile_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=3, help="calls per peer per round")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, a.dtype)
    cpu = detect().cpu
    print(f"CPU: {cpu.model}, {torch.get_num_threads()} threads; native bf16 {cpu.bf16_native}, "
          f"native fp16 {cpu.fp16_native}; torch {torch.__version__}")
    model, x = zoo.load(a.model, batch=a.batch)
    half = model.to(dtype).eval()
    args, kwargs = ((), x) if isinstance(x, dict) else ((x.to(dtype),), {})
    up = copy.deepcopy(half).float()
    stock_half = compile_model(half, {"freezing": True})
    stock_up = compile_model(up, {"freezing": True})

    def upcast(*a_, **k_):
        a_ = tuple(t.float() if t.is_floating_point() else t for t in a_)
        return inputs.tree_map(lambda t: t.to(dtype) if t.is_floating_point() else t, stock_up(*a_, **k_))

    t0 = time.perf_counter()
    fast = tk.optimize(half, sample_input=x if isinstance(x, dict) else args[0])
    setup = time.perf_counter() - t0
    peers = {"eager (as given)": half, "compile+freezing (as given)": stock_half,
             "compile+freezing on a float32 copy": upcast, "torchkiln": fast}
    times: dict[str, list[float]] = {n: [] for n in peers}
    with torch.no_grad():
        for f in peers.values():  # build and warm every peer first
            f(*args, **kwargs)
            f(*args, **kwargs)
        for r in range(a.rounds):
            names = list(peers)[r % len(peers):] + list(peers)[:r % len(peers)]  # rotate the order
            for n in names:
                one = []
                for _ in range(a.iters):
                    s = time.perf_counter()
                    peers[n](*args, **kwargs)
                    one.append(time.perf_counter() - s)
                times[n].append(statistics.median(one))
    ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    rep = fast.kiln_report
    print(f"torchkiln serves {rep.active!r} ({rep.dtype_served}); optimize {setup:.1f} s")
    print(f"\n| peer ({a.model} {a.dtype} bs{a.batch}) | ms per call | torchkiln speedup |\n|---|---|---|")
    for n, v in ms.items():
        print(f"| {n} | {v:.1f} | {v / ms['torchkiln']:.2f}x |")


if __name__ == "__main__":
    main()
