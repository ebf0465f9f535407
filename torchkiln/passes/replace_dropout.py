"""Dropout -> Identity. In eval mode dropout already does nothing, but the call
still costs a Python dispatch per layer and can block fusion in traced graphs."""

from __future__ import annotations

from torch import nn

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def replace_dropout(model: nn.Module) -> nn.Module:
    for name, child in list(model.named_children()):
        if isinstance(child, _DROPOUTS):
            setattr(model, name, nn.Identity())
        else:
            replace_dropout(child)
    return model
