"""Mixed precision on every device type, thin over torch.amp.

``tk.amp.autocast`` is ``torch.autocast`` with a clear error for a device type
autocast does not cover, and a dtype default chosen for the device (bf16 where
it is native, else fp16 on accelerators). ``tk.amp.GradScaler`` is
``torch.amp.GradScaler`` whose device defaults to where CUDA is, else the CPU
(torch's own default is "cuda" even on a machine without one).
"""

from __future__ import annotations

import torch


def _default_dtype(device_type: str) -> torch.dtype:
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16


def autocast(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True, cache_enabled=None):
    """``torch.autocast(device_type, dtype)``; dtype defaults to bf16, or fp16 on a GPU without bf16."""
    available = getattr(torch.amp, "is_autocast_available", None)
    try:
        ok = ":" not in device_type and (available is None or available(device_type))
    except RuntimeError:  # not a device type torch knows
        ok = False
    if not ok:
        raise ValueError(f"device_type={device_type!r} has no autocast in torch {torch.__version__}; "
                         "use 'cpu', 'cuda', 'xpu' or 'mps' (the device type, not 'cuda:0')")
    return torch.autocast(device_type, dtype=dtype or _default_dtype(device_type), enabled=enabled,
                          cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """Loss scaling for fp16 training (bf16 needs none). ``device`` defaults to "cuda"
    when CUDA is available, else "cpu"."""

    def __init__(self, device: str | None = None, **kwargs):
        super().__init__(device or ("cuda" if torch.cuda.is_available() else "cpu"), **kwargs)
