"""Where one CUDA decode step of tk.llm spends its time: the compiled step alone (no generate loop
around it), timed with CUDA events in interleaved rounds, and a kernel profile grouped by kind
(GEMV, attention, norm/pointwise, copies), per step. Variants change one thing on the served
decoder, so each row's difference is that thing's. Run on the GPU:

    python benchmarks/diag_llm_step.py --config llama-3-8b --variants served,sdpa-attn

(``math-attn`` and ``cublas-all``: the forms the first profile compared, RESULTS.md.)
"""

import argparse
import re
import statistics
import time
import types
from collections import defaultdict

import torch

import torchkiln as tk
from torchkiln.llm import bench
from torchkiln.llm.model import CublasLinear, _register_linear, grouped_attention, linear_of, rotate


def math_attention(self, x, cos, sin, slots, mask, table=None):
    """Layer.attention with the one-query attention written as two matmuls and a softmax (the CPU
    form), so inductor fuses it, instead of the opaque SDPA call."""
    s = self.spec
    B, T, _ = x.shape
    H, KV, D = s.n_heads, s.n_kv_heads, s.head_dim
    q, k, v = self.qkv(x).split([H * D, KV * D, KV * D], dim=-1)
    q, k, v = q.view(B, T, H, D).transpose(1, 2), k.view(B, T, KV, D).transpose(1, 2), v.view(B, T, KV, D).transpose(1, 2)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    self.k_cache.index_copy_(2, slots, k)
    self.v_cache.index_copy_(2, slots, v)
    o = grouped_attention(q, self.k_cache, self.v_cache, mask, self.scaling)
    return self.out(o.transpose(1, 2).reshape(B, T, H * D))


def cublas_all(decoder):
    _register_linear()
    for layer in decoder.layers:
        for name in ("qkv", "up"):
            m = getattr(layer, name)
            setattr(layer, name, linear_of(m.weight, m.bias, CublasLinear))
    decoder.head = linear_of(decoder.head.weight, decoder.head.bias, CublasLinear)


def sdpa_attention(runner):
    for layer in runner.decoder.layers:
        layer.decode_kernel = False


def cublas_o_down(runner):
    for layer in runner.decoder.layers:
        for name in ("out", "down"):
            m = getattr(layer, name)
            setattr(layer, name, linear_of(m.weight, m.bias, CublasLinear))


def unfolded(runner):
    for layer in runner.decoder.layers:
        layer.folded = None
    runner.decoder.head_g = None


def unroped(runner):
    for layer in runner.decoder.layers:
        layer.rope_kernel = False


TWEAKS = {  # each takes the Runner
    "served": lambda r: None,
    "unfolded": unfolded,  # --quant int8: norms, residual adds and silu * up outside the GEMVs
    "unroped": unroped,  # RoPE and the cache writes by inductor (not llm/qkv_rope.py's kernels)
    "sdpa-attn": sdpa_attention,  # torch's SDPA for the one-query attention (before decode_attention)
    "cublas-o-down": cublas_o_down,  # cuBLAS for o/down whatever cuda_projections measured
    "math-attn": lambda r: [setattr(la, "attention", types.MethodType(math_attention, la))
                            for la in r.decoder.layers],
    "cublas-all": lambda r: cublas_all(r.decoder),
}

KINDS = [  # (kind, regex over the kernel name), first match wins
    ("gemv (torchkiln Triton / tinygemm)", r"^_int8|^_int4|^_row|^_float|tinygemm"),
    ("gemv (cuBLAS)", r"gemv|gemm|cutlass|sm90_|splitKreduce|nvjet"),
    ("gemv (inductor, fused)", r"triton_red_fused.*(mm|addmm)"),
    ("attention", r"attention|flash|fmha|cudnn|softmax|sdpa|efficient"),
    ("copy / index", r"copy|index|cat|scatter|fill"),
    ("reduction (norm)", r"triton_red|triton_per"),
    ("pointwise", r"triton_poi"),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name, re.I):
            return kind
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3-8b")
    ap.add_argument("--variants", default="served,sdpa-attn")
    ap.add_argument("--new", type=int, default=128, help="new tokens of the generate timing")
    ap.add_argument("--profile", default="served,sdpa-attn", help="variants to profile")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--quant", default=None, help="int8 or int4: every variant quantized so")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = bench.build(a.config, dev, torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(dev)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    steps, fasts, ref = {}, {}, None
    for name in [v for v in a.variants.split(",") if v]:
        f = tk.llm.optimize(model, dtype=torch.bfloat16, quant=a.quant)
        runner = f._kiln_runner
        TWEAKS[name](runner)
        out = f.generate(ids, max_new_tokens=24, **kw)  # compiles the decode step
        ref = out if ref is None else ref
        print(f"{name}: compile {runner.report.compile_s} s; same tokens as the first variant: "
              f"{bool((out == ref).all())}; projections measured at build: {runner.report.cuda_gemv}", flush=True)
        tok = out[:, -1:].clone()
        slot = torch.tensor([out.shape[1]], device=dev)
        pos = slot[None].clone()
        fasts[name] = f
        steps[name] = (lambda runner=runner, tok=tok, slot=slot, pos=pos: runner.decode(tok, slot, pos))
    times, gen = defaultdict(list), defaultdict(lambda: defaultdict(list))
    first = next(iter(steps))
    for _ in range(a.rounds):
        for name, step in steps.items():
            runner = fasts[name]._kiln_runner
            # generate as users call it (prefill, then the loop around the step); the first variant
            # also with an eager prefill, what the prefill graphs buy
            for label, graphs in [(name, True)] + ([(f"{name}, eager prefill", False)] if name == first else []):
                runner.prefill_graphs = graphs
                for n in (a.new, 1):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fasts[name].generate(ids, max_new_tokens=n, **kw)
                    torch.cuda.synchronize()
                    gen[label][n].append(time.perf_counter() - t0)
            runner.prefill_graphs = True
            step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.steps):
                step()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / a.steps)
    wb = bench.weight_bytes(model, a.quant)
    print(f"\n{a.quant or 'bf16'} weights {wb / 1e9:.2f} GB; step alone: CUDA events over {a.steps} steps; generate: "
          f"prefill = T(1), decode = (T({a.new}) - T(1)) / {a.new - 1}, tok/s = {a.new} / T({a.new}); "
          f"{a.rounds} interleaved rounds, medians\n\n| variant | step alone ms | step weight TB/s | "
          "generate prefill ms | generate decode ms/token | generate tok/s |\n|---|---|---|---|---|---|")
    for name in gen:
        ms = statistics.median(times[name]) if name in times else float("nan")
        tn, t1 = statistics.median(gen[name][a.new]), statistics.median(gen[name][1])
        print(f"| {name} | {ms:.3f} | {wb / ms / 1e9:.2f} | {t1 * 1e3:.1f} | {(tn - t1) / (a.new - 1) * 1e3:.3f} | "
              f"{a.new / tn:.1f} |")
    from torch.profiler import ProfilerActivity, profile

    n = 20
    for name, step in [(n, steps[n]) for n in a.profile.split(",") if n in steps]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(n):
                step()
            torch.cuda.synchronize()
        per_kind, per_name = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
        for e in p.key_averages():
            if e.self_device_time_total <= 0:
                continue
            for table, key in ((per_kind, kind_of(e.key)), (per_name, e.key)):
                table[key][0] += e.count
                table[key][1] += e.self_device_time_total
        busy = sum(v[1] for v in per_kind.values()) / n
        count = sum(v[0] for v in per_kind.values()) / n
        print(f"\n--- {name}: {count:.0f} kernels per step, GPU busy {busy / 1e3:.3f} ms per step "
              f"(step {statistics.median(times[name]):.3f} ms)\n\n| kind | kernels/step | us/step |\n|---|---|---|")
        for kind, (c, us) in sorted(per_kind.items(), key=lambda kv: -kv[1][1]):
            print(f"| {kind} | {c / n:.0f} | {us / n:.1f} |")
        print("\n| kernel | kind | calls/step | us/call | us/step |\n|---|---|---|---|---|")
        for key, (c, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"| {key[:90]} | {kind_of(key)} | {c / n:.0f} | {us / c:.2f} | {us / n:.1f} |")


if __name__ == "__main__":
    main()
