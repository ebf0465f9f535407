"""Conv1d/2d/3d (and transposed) + BatchNorm -> one Conv with adjusted weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from .fold_bn import fold, folded_in_float32
from .registry import register

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _fuse(conv, bn):
    return folded_in_float32(fuse_conv_bn_eval, conv, bn, transpose=isinstance(conv, nn.modules.conv._ConvTransposeNd))


def fold_conv_bn(model: nn.Module) -> nn.Module:
    """Inference only: uses the running statistics. Mutates and returns ``model``."""
    return fold(model.eval(), _CONVS, _BNS, _fuse)[0]


@dataclass(frozen=True)
class FoldConvBNConfig:
    name: ClassVar[str] = "fold_conv_bn"


@register(FoldConvBNConfig, order=20)
def _apply(model, config, ctx):
    model, n = fold(model.eval(), _CONVS, _BNS, _fuse)
    return model, f"{n} folded"
