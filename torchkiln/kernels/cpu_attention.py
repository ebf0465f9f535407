"""``torchkiln::attention_bf16``: attention in bfloat16 on x86 CPUs through oneDNN's matmul and
softmax primitives, an op written in C++ (cpu_attention.cpp says why) and built here on first use.

It needs what the int8 net needs (pip's oneDNN with its headers: ``pip install "torchkiln[onednn]"``,
and a C++ compiler) plus torch's headers; the build takes about 15 s on 2 cores, once per machine and
torch version (``kernels/build.py`` caches it). Where any of it is missing, ``load()`` says why and
callers keep torch's ops.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import onednn_net

SOURCE = Path(__file__).with_name("cpu_attention.cpp")


@functools.cache
def load() -> str | None:
    """Register ``torch.ops.torchkiln.attention_bf16`` (building it if needed). None when it is
    ready; otherwise why not, in words."""
    why = onednn_net.load_torch_op(SOURCE)
    if why is None:
        torch.library.register_fake("torchkiln::attention_bf16")(_fake)
    return why


def _fake(q, k, v, bias, scale):
    b, h, n, d = q.shape
    return q.new_empty(b, n, h, d).transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """softmax(q @ k^T * scale + bias) @ v, bf16 [B, H, L, D] (``load()`` first)."""
    return torch.ops.torchkiln.attention_bf16(q, k, v, bias, scale)
