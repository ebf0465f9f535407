"""Where one bs1 call of tk.optimize's returned model goes on a GPU, against the stock
reduce-overhead peer: wall time per call (sync at the end of 300 calls), host time per call (no
sync), GPU busy time and kernels per call (torch.profiler), and a cProfile of 300 calls of the
returned model (own time, then cumulative). bert-base bf16 with the zoo's input. Run on the GPU:

    python benchmarks/diag_bs1_host.py
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchkiln as tk
from torchkiln import zoo


def timed(call, model, n: int, sync: bool) -> float:
    """ms per call over ``n`` calls; without ``sync`` the host's time alone (the GPU may lag)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(n):
            call(model)
    if sync:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    return ms


def main() -> int:
    dev = torch.device("cuda")
    model, x = zoo.load("bert-base", batch=1, seq=128)
    model = model.to(dev).eval()
    x = {k: v.to(dev) for k, v in x.items()}

    def call(m):
        return m(**x)

    fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=x)
    print(fast.kiln_report)
    stock = torch.compile(copy.deepcopy(model).to(torch.bfloat16), mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(5):
            call(stock)
            call(fast)
    res = {k: [] for k in ("torchkiln", "stock", "torchkiln host", "stock host")}
    for _ in range(5):  # interleaved rounds
        res["torchkiln"].append(timed(call, fast, 300, True))
        res["stock"].append(timed(call, stock, 300, True))
        res["torchkiln host"].append(timed(call, fast, 300, False))
        res["stock host"].append(timed(call, stock, 300, False))
    print("ms per call, medians of 5 rounds:", {k: round(statistics.median(v), 3) for k, v in res.items()})
    with torch.no_grad():
        for name, m in (("torchkiln", fast), ("stock", stock)):
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(20):
                    call(m)
                torch.cuda.synchronize()
            ev = p.key_averages()
            busy = sum(e.self_device_time_total for e in ev) / 20 / 1e3
            print(f"{name}: GPU busy {busy:.3f} ms per call, {sum(e.count for e in ev) / 20:.0f} kernels per call")
            for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:12]:  # where the GPU time goes
                print(f"  {e.count / 20:5.1f}/call {e.self_device_time_total / 20:7.1f} us  {e.key[:100]}")
    pr = cProfile.Profile()
    with torch.no_grad():
        pr.enable()
        for _ in range(300):
            call(fast)
        torch.cuda.synchronize()
        pr.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
