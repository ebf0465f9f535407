"""Shared by the diag_* scripts: build each variant, check it against the float32 model, time
them interleaved in one process and print the medians."""

from __future__ import annotations

import statistics

import torch

from torchkiln.timing import interleaved


def gpu_kernels(fn, iters: int = 20) -> dict[str, float]:
    """GPU time per call in us of each kernel name (torch.profiler's device time), after 3 warm-up calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.device_time / iters
    return per


def gpu_us(fn, iters: int = 20) -> float:
    """GPU kernel time per call in us: not the host's launch time, which bounds small eager kernels
    such as one attention layer."""
    return sum(gpu_kernels(fn, iters).values())


def synced_ms(fns: dict, rounds: int, iters: int) -> dict[str, float]:
    """Median wall ms per call of each CUDA function: ``iters`` calls between two synchronisations,
    in ``rounds`` interleaved rounds."""
    import time

    wall = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                f()
            torch.cuda.synchronize()
            wall[name].append((time.perf_counter() - t) / iters * 1e3)
    return {name: statistics.median(w) for name, w in wall.items()}


def bert_bf16_cuda(batch: int):
    """bert-base from the zoo in bf16 on the GPU, and its input (seq 128)."""
    from torchkiln.zoo import load

    model, x = load("bert-base", batch=batch)
    return model.to("cuda").to(torch.bfloat16).eval(), {k: v.to("cuda") for k, v in x.items()}


def build_bert(builds: dict, reference, x: dict, against: str) -> dict:
    """Build each bert variant (three calls), print its relative L2 difference to ``reference``'s
    last hidden state (a failure is printed, not raised); {name: a call on ``x``} of those built."""
    fns = {}
    with torch.no_grad():
        ref = reference(**x).last_hidden_state.float()
        for name, build in builds.items():
            try:
                m = build()
                for _ in range(3):
                    out = m(**x)
                err = float((out.last_hidden_state.float() - ref).norm() / ref.norm())
                fns[name] = lambda m=m: m(**x)
                print(f"{name}: rel L2 vs {against} {err:.4f}"
                      + (f", served {m.kiln_report.active}" if hasattr(m, "kiln_report") else ""))
            except Exception as e:  # noqa: BLE001
                print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
    return fns


def fp8_args(doc: str):
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    return ap.parse_args()


def _first(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def check_and_time(fns: dict, model, args, kwargs, device: torch.device, budget: float):
    """Three warm-up calls of each variant, its relative L2 error against ``model`` (printed), then
    interleaved timing. Returns (calls, times in seconds, medians in ms)."""
    calls = {}
    with torch.no_grad():
        ref = _first(model(*args, **kwargs)).float()
        for n, f in fns.items():
            for _ in range(3):
                out = f(*args, **kwargs)
            err = ((_first(out).float() - ref).norm() / ref.norm()).item()
            print(f"{n:36s} built, rel err vs float32 {err:.2e}", flush=True)
            calls[n] = (lambda f=f: f(*args, **kwargs))
        times = interleaved(calls, device, budget, min_rounds=5, prune=100)
    return calls, times, {n: statistics.median(t) * 1e3 for n, t in times.items()}


def print_table(title: str, times: dict, med: dict, batch: int | None = None) -> None:
    best = min(med.values())
    print(f"\n{title}")
    for n, m in sorted(med.items(), key=lambda kv: kv[1]):
        rate = f"  {batch / m * 1e3:9.0f}/s" if batch else ""
        print(f"  {n:36s} {m:8.3f} ms{rate}  {m / best:5.2f}x best  ({len(times[n])} rounds)")


def cases(model: str, batch: int, budget: float):
    """Parses --device/--model/--batch (several)/--budget and yields, per batch, (parsed args, device,
    batch, the zoo model on the device, its sample args and kwargs, torchkiln's bf16 O1 recipe)."""
    import argparse

    import torchkiln as tk
    from torchkiln import inputs, zoo
    from torchkiln.plan import plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=model)
    ap.add_argument("--batch", type=int, nargs="+", default=[batch])
    ap.add_argument("--budget", type=float, default=budget)
    a = ap.parse_args()
    dev = torch.device(a.device)
    for b in a.batch:
        net, x = zoo.load(a.model, batch=b)
        net = net.to(dev).eval()
        args, kwargs = inputs.to(inputs.normalize(x), dev)
        yield a, dev, b, net, args, kwargs, plan(net, tk.detect(), a.device, torch.bfloat16, "O1", {}, batch=b)
