"""Does inductor's C++ wrapper pay for a quantized (pt2e int8) CPU graph? The same tk.quantize'd model
compiled with freezing, with and without ``cpp_wrapper``, interleaved in one process (bs1).

    python benchmarks/diag_quant_wrapper.py --models resnet50,bert-base
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import torchkiln as tk
from torchkiln.passes.compile import compile_model
from torchkiln.timing import interleaved
from torchkiln.zoo import load

warnings.filterwarnings("ignore")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--budget", type=float, default=20.0)
    a = ap.parse_args()
    for name in a.models.split(","):
        model, sample = load(name, batch=1)
        args = ((sample,), {}) if isinstance(sample, torch.Tensor) else ((), dict(sample))
        g = torch.Generator().manual_seed(1)
        if name == "resnet50":
            calib = [torch.randn(1, 3, 224, 224, generator=g) for _ in range(4)]
        else:
            calib = [{"input_ids": torch.randint(0, 30522, (1, 128), generator=g),
                      "attention_mask": torch.ones(1, 128, dtype=torch.long)} for _ in range(4)]
        q = tk.quantize(model, "int8-static", calib_data=calib, sample_input=sample, progress=False)
        fns = {}
        for tag, opts in (("freezing", {"freezing": True}), ("freezing + cpp_wrapper", {"freezing": True, "cpp_wrapper": True})):
            f = compile_model(q, opts, fullgraph=True, private=True)
            t = time.perf_counter()
            with torch.no_grad():
                f(*args[0], **args[1])
            print(f"{name} {tag}: compiled in {time.perf_counter() - t:.0f} s", flush=True)
            fns[tag] = f
        with torch.no_grad():
            outs = [f(*args[0], **args[1]) for f in fns.values()]
            a0 = outs[0] if isinstance(outs[0], torch.Tensor) else outs[0][0]
            a1 = outs[1] if isinstance(outs[1], torch.Tensor) else outs[1][0]
            print(f"  max |difference| between the two: {float((a0 - a1).abs().max()):.3g}")
            times = interleaved({n: (lambda f=f, args=args: f(*args[0], **args[1])) for n, f in fns.items()},
                                torch.device("cpu"), a.budget, min_rounds=7, prune=100)
        ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        base = ms["freezing"]
        for n, v in ms.items():
            print(f"| {name} bs1 int8-static | {n} | {v:.2f} ms | {base / v:.3f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
