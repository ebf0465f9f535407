"""``torchkiln::qlinear_u8``: a pt2e int8 linear through one oneDNN matmul per weight and row count,
built and packed once (cpu_qlinear.cpp says why); built here on first use, like ``cpu_attention``
(pip's oneDNN with headers, a C++ compiler, torch's headers). Where any is missing, ``load()`` says
why and the graph keeps inductor's int8 linears.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import onednn_net

SOURCE = Path(__file__).with_name("cpu_qlinear.cpp")


@functools.cache
def load() -> str | None:
    """Register ``torch.ops.torchkiln.qlinear_u8`` (building it if needed). None when it is ready;
    otherwise why not, in words."""
    why = onednn_net.load_torch_op(SOURCE)
    if why is None:
        torch.library.register_fake("torchkiln::qlinear_u8")(_fake)
    return why


def _fake(x, x_scale, x_zp, w, w_scale, w_zp, bias, post, out_scale, out_zp):
    return x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.uint8 if out_scale > 0 else torch.float32)


def qlinear(x: torch.Tensor, x_scale: float, x_zp: int, w: torch.Tensor, w_scale: torch.Tensor,
            bias: torch.Tensor | None, post: str = "none", out_scale: float = 0.0, out_zp: int = 0,
            w_zp: torch.Tensor | None = None) -> torch.Tensor:
    """``linear((x - x_zp) * x_scale, w * w_scale[:, None], bias)``, then ``post``; with ``out_scale``
    > 0 quantized to uint8 (``load()`` first). ``w_zp``: the weight's zero points, which must be 0."""
    zp = torch.zeros(w.shape[0], dtype=torch.long) if w_zp is None else w_zp
    return torch.ops.torchkiln.qlinear_u8(x, x_scale, x_zp, w, w_scale, zp, bias, post, out_scale, out_zp)
