"""NHWC ("channels_last") weights for conv nets: oneDNN and cuDNN run their
fastest convolution kernels in that layout, and keeping weights there avoids a
reorder on every call. Inputs are converted by the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .registry import register
from .tensors import remake


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

    def nhwc(t):
        if t.dim() not in (4, 5):
            return t
        return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)

    return remake(model, nhwc)


@dataclass(frozen=True)
class ChannelsLastConfig:
    name: ClassVar[str] = "channels_last"


@register(ChannelsLastConfig, order=60)
def _apply(model, config, ctx):
    fmt = memory_format_for(model)
    return channels_last(model), str(fmt).removeprefix("torch.") if fmt else "no convolutions"
