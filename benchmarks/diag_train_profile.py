"""Where a training step's GPU time goes: the stock recipe (torch.compile + autocast +
fused AdamW) profiled, its kernels summed by kind and listed by time.

    python benchmarks/diag_train_profile.py --model gpt2-medium --batch 16 --seq 512

Kinds are read off kernel names: GEMMs (cuBLAS/CUTLASS/nvjet), attention (flash,
cuDNN, memory-efficient), the optimizer (fused Adam / multi-tensor), inductor's
Triton kernels, and the rest. Per-step milliseconds over --steps profiled steps.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile
from train_step import CONFIGS, build, make_step

KINDS = (("attention", ("flash", "fmha", "cudnn", "attention", "efficient")),
         ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
         ("optimizer", ("adam", "multi_tensor", "foreach")),
         ("triton", ("triton_",)))


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-medium", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    model = build(a.model, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    step = make_step(torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), batch,
                     "cuda", torch.bfloat16, True)
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    per = collections.Counter()
    by_kind = collections.Counter()
    count = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time / 1e3 / a.steps
            count[e.name] += 1
    for n, ms in per.items():
        by_kind[kind(n)] += ms
    total = sum(per.values())
    print(f"{a.model} bs{a.batch} seq{a.seq}, stock compile+autocast+fused AdamW: GPU kernel time "
          f"{total:.2f} ms/step")
    for k, ms in by_kind.most_common():
        print(f"  {k:10s} {ms:8.2f} ms  {ms / total:6.1%}")
    print(f"\ntop {a.top} kernels (ms/step, calls/step):")
    for n, ms in per.most_common(a.top):
        print(f"  {ms:7.3f}  {count[n] // a.steps:4d}  {kind(n):9s} {n[:110]}")


if __name__ == "__main__":
    main()
