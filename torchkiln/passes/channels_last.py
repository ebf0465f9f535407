"""NHWC ("channels_last") weights for conv nets: oneDNN and cuDNN run their
fastest convolution kernels in that layout, and keeping weights there avoids a
reorder on every call. Inputs are converted by the runner."""

from __future__ import annotations

import torch
from torch import nn


def memory_format_for(model: nn.Module) -> torch.memory_format | None:
    kinds = {type(m) for m in model.modules()}
    if kinds & {nn.Conv3d, nn.ConvTranspose3d}:
        return torch.channels_last_3d
    if kinds & {nn.Conv2d, nn.ConvTranspose2d}:
        return torch.channels_last
    return None


def channels_last(model: nn.Module) -> nn.Module:
    """New weight tensors in the channels-last layout. Module.to(memory_format=...)
    is not used: it rewrites ``param.data`` in place, and optimize() shares
    parameters with the caller's model."""
    fmt = memory_format_for(model)
    if fmt is None:
        return model
    for mod in model.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None and p.dim() in (4, 5):
                f = torch.channels_last if p.dim() == 4 else torch.channels_last_3d
                mod._parameters[key] = nn.Parameter(p.detach().contiguous(memory_format=f),
                                                    requires_grad=p.requires_grad)
    return model
