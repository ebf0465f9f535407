"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights, per input channel,
before static int8 quantization: y = (x / s) (W s)^T with s_j = max|x_j|^a / max|W_j|^(1-a).

Hand-written because torchao's SmoothQuantConfig feeds its own (torchao tensor-subclass)
int8 linear, which on CPU runs through ``torch._int_mm``'s reference kernel (schemes.py); here
the smoothed linear goes through the same pt2e/oneDNN flow as int8-static. The division is an
explicit multiply in front of each linear rather than folded into a preceding LayerNorm: it
works for any producer, and inductor fuses it into the activation's quantize kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import inputs
from .calibrate import layer_inputs


class SmoothedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, scale: torch.Tensor):
        super().__init__()
        self.linear = linear
        with torch.no_grad():
            linear.weight.mul_(scale.to(linear.weight.dtype))
        self.register_buffer("inv_scale", (1.0 / scale).to(linear.weight.dtype))

    def forward(self, x):
        return self.linear(x * self.inv_scale)


def activation_absmax(model: nn.Module, data: list[inputs.Args], names: list[str], device) -> dict[str, torch.Tensor]:
    """Per input channel max |x| of each named linear over the calibration batches."""
    amax: dict[str, torch.Tensor] = {}

    def record(name, x):
        cur = x.abs().reshape(-1, x.shape[-1]).amax(0).float()
        amax[name] = torch.maximum(amax[name], cur) if name in amax else cur

    layer_inputs(model, names, data, device, record)
    return amax


def smooth(model: nn.Module, amax: dict[str, torch.Tensor], alpha: float) -> int:
    """Replace each linear with its smoothed form, in place (``model`` is torchkiln's copy)."""
    count = 0
    for name, a in amax.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lin = getattr(owner, child)
        w = lin.weight.detach().abs().amax(0).float().clamp(min=1e-5)
        s = (a.clamp(min=1e-5).pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)
        setattr(owner, child, SmoothedLinear(lin, s.to(lin.weight.device)))
        count += 1
    return count
