"""Choices every device family starts from."""

from __future__ import annotations

import torch
from torch import nn

from ..passes import registry


def base_passes(dtype: torch.dtype, has_conv: bool, channels_last: bool = True) -> tuple[list, str]:
    """The eager passes that pay everywhere (as configs), and the memory format for conv nets."""
    passes = [registry.make(n) for n in ("replace_dropout", "fold_conv_bn", "fold_linear_bn")]
    if dtype != torch.float32:
        passes.append(registry.make("cast_dtype", dtype=str(dtype).removeprefix("torch.")))
    if has_conv and channels_last:
        passes.append(registry.make("channels_last"))
        return passes, "channels_last"
    return passes, "contiguous"


def is_hf(model: nn.Module) -> bool:
    """A transformers model: its forward treats attention_mask=None as all ones."""
    return type(model).__module__.startswith("transformers.") and hasattr(model, "config")
