"""inductor's Triton GEMM templates (``max_autotune_gemm``) against torchkiln's plan (cuBLAS) for bert-base
bf16 at several batch sizes (seq 128): per batch, both built with tk.optimize (torchkiln's candidates only),
then timed in one process, interleaved (7 rounds, medians). Tried for #6's bs1 target; not adopted
(RESULTS.md, thirtieth session). Run on the GPU:

    python benchmarks/diag_rows_autotune.py 1,2,4,16
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
import warnings

import torch

import torchkiln as tk
from torchkiln import zoo

VARIANTS = {"plan": {}, "max_autotune_gemm": {"compile_options": {"max_autotune_gemm": True}}}


def ms_per_call(fn, x: dict, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(**x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> int:
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)  # autotuning logs every candidate kernel
    for batch in (int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,16").split(",")):
        model, x = zoo.load("bert-base", batch=batch, seq=128)
        model = model.cuda().eval()
        x = {k: v.cuda() for k, v in x.items()}
        built = {}
        for name, kw in VARIANTS.items():
            t0 = time.time()
            built[name] = tk.optimize(model, dtype=torch.bfloat16, sample_input=x, candidates="torchkiln", **kw)
            with torch.no_grad():
                built[name](**x)
            print(f"bs{batch} (rows {batch * 128}): {name} built in {time.time() - t0:.1f} s, "
                  f"{built[name].kiln_report.active}", flush=True)
        res: dict[str, list[float]] = {k: [] for k in built}
        n = max(20, 200 // batch)
        with torch.no_grad():
            for fn in built.values():
                ms_per_call(fn, x, 5)
            for _ in range(7):
                for name, fn in built.items():
                    res[name].append(ms_per_call(fn, x, n))
        plan = statistics.median(res["plan"])
        for name, v in res.items():
            print(f"bs{batch} {name:20s} {statistics.median(v):.3f} ms  plan/this {plan / statistics.median(v):.3f}x",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
