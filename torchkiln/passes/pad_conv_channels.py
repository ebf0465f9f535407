"""Zero input channels appended to a convolution with a few (an RGB stem), so cuDNN's tensor-core
kernels apply: in channels_last they want the channel count a multiple of 8 (16 bytes of half
precision). The result is the same sum (the added terms are 0 * 0).

Measured on H200s, resnet50 bf16 channels_last, torchkiln's compiled recipe, interleaved in one
process (``benchmarks/diag_stem_pad.py``), median ms as given / padded to 4 / padded to 8:
bs256 10.12 / 9.87 / 9.83 and 10.11 / 10.03 / 9.98 (two leases; GPU time 9.62 / 9.46 / 9.45 and
9.76 / 9.70 / 9.62), bs64 2.89 / 2.91 / 2.87 (GPU 2.61 / 2.57 / 2.57). Small (1-3%), and 8 never
behind 4. Not on the CPU: oneDNN has its own kernel for 3-channel inputs (the same script, bs2:
43.1 vs 42.5 ms, noise)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .fold_bn import set_submodule
from .registry import register


class PaddedConv2d(nn.Conv2d):
    """A Conv2d whose weight has more input channels than its inputs: they get zero channels
    appended (dimension -3, batched or not) up to the weight's count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (0, 0, 0, 0, 0, self.in_channels - x.shape[-3])))


def _eligible(m: nn.Module, multiple: int) -> bool:
    # Exactly nn.Conv2d: a subclass may change forward (weight standardisation, ...); hooks would
    # see the padded input; other padding modes pad spatially with the channels' values.
    return (type(m) is nn.Conv2d and m.groups == 1 and m.in_channels < multiple
            and m.padding_mode == "zeros" and not (m._forward_hooks or m._forward_pre_hooks))


def padded(conv: nn.Conv2d, to: int) -> PaddedConv2d:
    """A new module: ``conv``'s weight with zero input channels appended (a new tensor: the
    caller's model shares ``conv``'s), its bias shared."""
    w = conv.weight.detach()
    new = PaddedConv2d(to, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                       1, False, device="meta")
    zeros = w.new_zeros(w.shape[0], to - w.shape[1], *w.shape[2:])
    new.weight = nn.Parameter(torch.cat([w, zeros], dim=1), requires_grad=conv.weight.requires_grad)
    new.bias = conv.bias
    new.train(conv.training)
    return new


def pad_conv_channels(model: nn.Module, multiple: int = 8) -> tuple[nn.Module, list[str]]:
    """Replaces each eligible Conv2d of fewer than ``multiple`` input channels; returns the model
    and the names replaced."""
    names = [n for n, m in model.named_modules() if n and _eligible(m, multiple)]
    for n in names:
        set_submodule(model, n, padded(model.get_submodule(n), multiple))
    return model, names


@dataclass(frozen=True)
class PadConvChannelsConfig:
    name: ClassVar[str] = "pad_conv_channels"
    multiple: int = 8


@register(PadConvChannelsConfig, order=55)
def _apply(model, config, ctx):
    was = {n: m.in_channels for n, m in model.named_modules() if n and _eligible(m, config.multiple)}
    model, names = pad_conv_channels(model, config.multiple)
    if not names:
        return model, "no convolution of few input channels"
    return model, ", ".join(f"{n} {was[n]}->{config.multiple}" for n in names) + " input channels"
