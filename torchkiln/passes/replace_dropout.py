"""Dropout -> Identity. In eval mode dropout already does nothing, but the call
still costs a Python dispatch per layer and can block fusion in traced graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from .registry import register

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def replace_dropout(model: nn.Module) -> nn.Module:
    for name, child in list(model.named_children()):
        if isinstance(child, _DROPOUTS):
            setattr(model, name, nn.Identity())
        else:
            replace_dropout(child)
    return model


@dataclass(frozen=True)
class ReplaceDropoutConfig:
    name: ClassVar[str] = "replace_dropout"


@register(ReplaceDropoutConfig, order=10)
def _apply(model, config, ctx):
    n = sum(isinstance(m, _DROPOUTS) for m in model.modules())
    return replace_dropout(model), f"{n} replaced"
