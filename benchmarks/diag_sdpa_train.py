"""Which SDPA kernel a training step should use: each backend's forward+backward at
GPT-2-medium's attention shape (with and without attention dropout), then the whole
stock training step (torch.compile + autocast + fused AdamW) compiled under torch's
default backend order against the same compiled with flash attention first.

    python benchmarks/diag_sdpa_train.py --model gpt2-medium --batch 16 --seq 512

Kernel timings: torch.profiler device time per call over --iters calls. Steps: their
GPU time (profiled), then wall time in interleaved rounds (torchkiln.timing.interleaved), medians.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F
from _variants import gpu_us
from torch.nn.attention import SDPBackend, sdpa_kernel
from train_step import CONFIGS, build, make_step

from torchkiln.timing import interleaved

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def gpu_ms(fn, iters: int) -> float:
    return gpu_us(fn, iters) / 1e3


def kernels(batch: int, heads: int, seq: int, dim: int, iters: int) -> None:
    print(f"SDPA forward+backward GPU time, bf16, B={batch} H={heads} S={seq} D={dim}, causal (ms per call); "
          "'model layout': q, k, v as transposed views of one [B, S, 3E] projection, as GPT-2 has them")
    print(f"{'backend':10s} {'layout':13s} {'dropout 0':>10s} {'dropout 0.1':>12s}")
    e = heads * dim
    qkv = torch.randn(batch, seq, 3 * e, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)
    for name, be in BACKENDS.items():
        for layout in ("contiguous", "model layout"):
            row = []
            for p in (0.0, 0.1):
                def call(p=p, be=be, layout=layout):
                    q, k, v = (t.view(batch, seq, heads, dim).transpose(1, 2) for t in qkv.split(e, dim=2))
                    if layout == "contiguous":
                        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
                    with sdpa_kernel([be]):
                        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
                    o.backward(g)
                try:
                    row.append(f"{gpu_ms(call, iters):.3f}")
                except RuntimeError as err:
                    row.append("n/a")
                    print(f"  ({name}, dropout {p}: {str(err).splitlines()[0][:90]})")
            print(f"{name:10s} {layout:13s} {row[0]:>10s} {row[1]:>12s}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-medium", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget", type=float, default=20.0)
    a = ap.parse_args()
    base = build(a.model, "cuda")
    cfg = base.config
    heads = getattr(cfg, "n_head", None) or cfg.num_attention_heads
    hidden = getattr(cfg, "n_embd", None) or cfg.hidden_size
    kernels(a.batch, heads, a.seq, hidden // heads, a.iters)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    steps = {}
    forced = {"default order": None, "flash only": [SDPBackend.FLASH_ATTENTION],
              "efficient only": [SDPBackend.EFFICIENT_ATTENTION], "cudnn only": [SDPBackend.CUDNN_ATTENTION]}
    for label, only in forced.items():
        m = copy.deepcopy(base)
        step = make_step(torch.compile(m), torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True), batch, "cuda",
                         torch.bfloat16, True)
        if only is not None:
            def step(inner=step, only=only):
                with sdpa_kernel(only):
                    inner()
        try:
            for _ in range(3):
                step()
        except Exception as err:  # noqa: BLE001 (a backend that cannot run this step)
            print(f"  {label}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        print(f"  {label}: step GPU time {gpu_ms(step, 3):.2f} ms", flush=True)
        steps[label] = step
    times = interleaved(steps, torch.device("cuda"), a.budget, min_rounds=5)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(f"\n{a.model} bs{a.batch} seq{a.seq} training step, stock compile+autocast+fused AdamW:")
    for n, ms in med.items():
        print(f"  {n:14s} {ms:7.2f} ms/step  {a.batch * a.seq / ms * 1e3:,.0f} tokens/s  "
              f"x default {med['default order'] / ms:.3f}")


if __name__ == "__main__":
    main()
