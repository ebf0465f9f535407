"""What a key-padding mask costs SDPA on the GPU, by mask form and kernel.

    python benchmarks/diag_sdpa_mask.py --batch 64 1

bert-base's attention shape (12 heads, seq 128, head dim 64), bf16, forward only. The
mask is transformers' form of a 2-D attention_mask: (B, 1, 1, S) expanded to
(B, 1, S, S) (stride 0 along the queries), as a bool or an additive float bias, or
materialised contiguous. Each form under torch's default kernel order and with one
backend forced; GPU kernel time per call (torch.profiler), the mask conversion
included where a form needs one.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _variants import gpu_us
from torch.nn.attention import SDPBackend, sdpa_kernel

FORCED = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}


def one_batch(b: int, a) -> None:
    q, k, v = (torch.randn(b, a.heads, a.seq, a.dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keep = torch.ones(b, a.seq, dtype=torch.bool, device="cuda")
    keep[:, -a.seq // 8:] = False  # padded tail
    boolx = keep[:, None, None, :].expand(b, 1, a.seq, a.seq)
    bias1 = torch.zeros(b, 1, 1, a.seq, device="cuda", dtype=torch.bfloat16).masked_fill(~keep[:, None, None, :],
                                                                                         float("-inf"))
    forms = {
        "no mask": lambda: None,
        "bool (B,1,S,S) expanded": lambda: boolx,
        "bias (B,1,S,S) expanded": lambda: bias1.expand(b, 1, a.seq, a.seq),
        "bias (B,1,S,S) materialised": lambda: bias1.expand(b, 1, a.seq, a.seq).contiguous(),
        "bias (B,H,S,S) expanded": lambda: bias1.expand(b, a.heads, a.seq, a.seq),
    }
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=boolx)
    print(f"\nbatch {b}: us per call (GPU kernels), max abs error vs float32 math in brackets")
    print(f"{'mask form':30s}" + "".join(f"{n:>20s}" for n in FORCED))
    for name, make in forms.items():
        row = []
        for be in FORCED.values():
            def call(make=make, be=be):
                m = make()
                if be is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            try:
                out = call()
                err = "-" if name == "no mask" else f"{(out.float() - ref).abs().max().item():.0e}"
                row.append(f"{gpu_us(call):8.1f} [{err}]")
            except RuntimeError:
                row.append("n/a")
        print(f"{name:30s}" + "".join(f"{c:>20s}" for c in row))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=64)
    a = ap.parse_args()
    for b in a.batch:
        one_batch(b, a)


if __name__ == "__main__":
    main()
