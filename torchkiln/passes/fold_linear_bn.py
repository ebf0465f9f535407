"""Linear + BatchNorm1d -> one Linear with adjusted weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn
from torch.nn.utils.fusion import fuse_linear_bn_eval

from .fold_bn import fold, folded_in_float32
from .registry import register


def _fuse(linear, bn):
    if linear.out_features != bn.num_features:
        # BatchNorm1d over a (N, C, L) input normalises another axis: not foldable.
        return None
    return folded_in_float32(fuse_linear_bn_eval, linear, bn)


def fold_linear_bn(model: nn.Module) -> nn.Module:
    return fold(model.eval(), (nn.Linear,), (nn.BatchNorm1d,), _fuse)[0]


@dataclass(frozen=True)
class FoldLinearBNConfig:
    name: ClassVar[str] = "fold_linear_bn"


@register(FoldLinearBNConfig, order=30)
def _apply(model, config, ctx):
    model, n = fold(model.eval(), (nn.Linear,), (nn.BatchNorm1d,), _fuse)
    return model, f"{n} folded"
