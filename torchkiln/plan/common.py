"""Choices every device family starts from."""

from __future__ import annotations

import torch
from torch import nn

from ..passes import registry


def cast_pass(dtype: torch.dtype, islands: bool = True):
    """The cast to a low precision; ``islands=False`` keeps no modules in fp32 (a family whose
    norm and softmax kernels accumulate in fp32 already)."""
    return registry.make("cast_dtype", dtype=str(dtype).removeprefix("torch."),
                         **({} if islands else {"fp32_modules": ()}))


def base_passes(dtype: torch.dtype, has_conv: bool, channels_last: bool = True,
                islands: bool = True) -> tuple[list, str]:
    """The eager passes that pay everywhere (as configs), and the memory format for conv nets."""
    passes = [registry.make(n) for n in ("replace_dropout", "fold_conv_bn", "fold_linear_bn")]
    if dtype != torch.float32:
        passes.append(cast_pass(dtype, islands))
    if has_conv and channels_last:
        passes.append(registry.make("channels_last"))
        return passes, "channels_last"
    return passes, "contiguous"


def is_hf(model: nn.Module) -> bool:
    """A transformers model: its forward treats attention_mask=None as all ones."""
    return type(model).__module__.startswith("transformers.") and hasattr(model, "config")
