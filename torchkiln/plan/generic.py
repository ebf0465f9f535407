"""Any other torch.accelerator device (xpu, mps, out-of-tree backends): the
conservative recipe. Low precision only where the probe saw native support,
torch.compile with its default backend, and the usual eager passes."""

from __future__ import annotations

import torch

from ..hardware import Hardware
from ..recipe import Recipe
from . import cuda
from .common import base_passes


def choose_dtype(hw: Hardware, device: str, dtype: torch.dtype):
    return cuda.choose_dtype(hw, device, dtype)


def plan(model, hw: Hardware, device, dtype, level, has_conv, batch, notes, rows=None) -> Recipe:
    dev_type = torch.device(device).type
    passes, fmt = base_passes(dtype, model, channels_last=dev_type == "xpu")
    notes.append(f"{dev_type}: generic recipe (no device-specific tuning yet)")
    # MPS inductor support is young; compile is tried and falls back if it fails.
    return Recipe(device=device, dtype_mode="cast" if dtype != torch.float32 else "none",
                  passes=tuple(passes), memory_format=fmt, compile=True,
                  compile_options=(("freezing", True),), notes=tuple(notes))
