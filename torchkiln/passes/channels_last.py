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
    fmt = memory_format_for(model)
    return model.to(memory_format=fmt) if fmt is not None else model
