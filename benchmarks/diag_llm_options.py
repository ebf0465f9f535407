"""Why tk.llm's CUDA decode step runs at its rate: compile options side by side (one process,
interleaved rounds), weight-only int8/int4 at the chosen options, and a kernel profile of one
decoded sequence. Run on the GPU:

    python benchmarks/diag_llm_options.py --config llama-3-8b
"""

import argparse
import statistics
import time

import torch

import torchkiln as tk
from torchkiln.llm import bench
from torchkiln.llm.model import cublas_projections
from torchkiln.quantization import gemv

VARIANTS = {
    "cudagraphs": {"triton.cudagraphs": True},
    "cudagraphs+coordinate_descent": {"triton.cudagraphs": True, "coordinate_descent_tuning": True},
    # as served, but the o and down projections left to inductor (plain nn.Linear, not CublasLinear)
    "inductor-o-down": {"triton.cudagraphs": True, "coordinate_descent_tuning": True},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3-8b")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quant", default="int8,int4")
    ap.add_argument("--profile", action="store_true", help="a kernel profile of 16 decoded tokens per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = bench.build(a.config, dev, torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(dev)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    fasts, first = {}, {}
    for name, opts in [(v, VARIANTS[v]) for v in a.variants.split(",") if v]:
        f = tk.llm.optimize(model, dtype=torch.bfloat16)
        f._kiln_runner.options = dict(opts)
        if name == "inductor-o-down":
            cublas_projections(f._kiln_runner.decoder, on=False)
        fasts[name] = f
    from torchkiln.llm import fused
    from torchkiln.llm import quant as llm_quant

    # int4-tinygemm / -torchao / -triton: force one int4 kernel; a "-bytes" suffix: the per-byte
    # one-row GEMVs (gemv.ONE_ROW) instead of the served word kernels; "-expr": int8 prefill through
    # the dequantizing expression instead of the int8 matmul kernel (gemv.WIDE_ROWS); "-unfolded":
    # decode without the norms, residual adds and silu * up inside the int8 GEMVs / torchkiln's int4
    # kernel (llm/fused.py); "-head8": int4 layers under an int8 output head (llm/quant.py INT4_HEAD)
    wide_rows = gemv.WIDE_ROWS
    for q in [q for q in a.quant.split(",") if q]:
        impl = [p for p in q.split("-")[1:] if p not in ("bytes", "expr", "unfolded", "head8")]
        llm_quant.INT4_IMPL = impl[0] if impl else "auto"
        fused.ON = "-unfolded" not in q
        llm_quant.INT4_HEAD = "-head8" not in q
        fasts[q] = tk.llm.optimize(model, dtype=torch.bfloat16, quant=q.split("-")[0])
    llm_quant.INT4_IMPL, fused.ON, llm_quant.INT4_HEAD = "auto", True, True

    def one_row(name):  # set before every call: a graph (re)captured then takes that kernel
        gemv.ONE_ROW = "bytes" if name.endswith("-bytes") else "auto"
        gemv.WIDE_ROWS = gemv.MAX_ROWS if name.endswith("-expr") else wide_rows

    for name, f in fasts.items():
        one_row(name)
        torch.cuda.synchronize()
        t = time.perf_counter()
        f.generate(ids, max_new_tokens=a.new, **kw)
        torch.cuda.synchronize()
        first[name] = time.perf_counter() - t
        f.generate(ids, max_new_tokens=1, **kw)
        print(f"{name}: first generate {first[name]:.1f} s, report: compile {f.kiln_report.compile_s} "
              f"quant cosine {f.kiln_report.quant_cosine} verify {f.kiln_report.verify_error:.3g}", flush=True)
    times = {n: {"n": [], "1": []} for n in fasts}
    for _ in range(a.rounds):
        for name, f in fasts.items():
            one_row(name)
            for key, n in (("n", a.new), ("1", 1)):
                torch.cuda.synchronize()
                t = time.perf_counter()
                f.generate(ids, max_new_tokens=n, **kw)
                torch.cuda.synchronize()
                times[name][key].append(time.perf_counter() - t)
    wb = bench.weight_bytes(model, None)
    bw = bench.copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; bf16 weights {wb / 1e9:.2f} GB")
    print("| variant | tok/s (128 new) | 1-token call ms | decode ms/token | decode tok/s | weight GB/s | % copy bw |")
    print("|---|---|---|---|---|---|---|")
    for name in fasts:
        tn, t1 = statistics.median(times[name]["n"]), statistics.median(times[name]["1"])
        dec = (tn - t1) / (a.new - 1)
        q = name.split("-")[0] if name.startswith("int") else None
        gbps = bench.weight_bytes(model, q) / dec / 1e9
        print(f"| {name} | {a.new / tn:.1f} | {t1 * 1e3:.1f} | {dec * 1e3:.2f} | {1 / dec:.1f} | {gbps:.0f} | {100 * gbps * 1e9 / bw:.0f}% |")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, f in fasts.items():
            one_row(name)
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                t = time.perf_counter()
                f.generate(ids, max_new_tokens=16, **kw)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            ev = p.key_averages()
            busy = sum(e.self_device_time_total for e in ev) / 1e3
            launches = sum(e.count for e in ev)
            print(f"--- {name}: CUDA kernels over 16 tokens: {launches} kernels, {busy:.1f} ms GPU busy "
                  f"of {wall * 1e3:.1f} ms wall")
            print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=80))


if __name__ == "__main__":
    main()
