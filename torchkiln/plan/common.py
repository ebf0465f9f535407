"""Choices every device family starts from."""

from __future__ import annotations

import torch


def base_passes(dtype: torch.dtype, has_conv: bool, channels_last: bool = True) -> tuple[set[str], str]:
    """The eager passes that pay everywhere, and the memory format for conv nets."""
    passes = {"replace_dropout", "fold_conv_bn", "fold_linear_bn"}
    if dtype != torch.float32:
        passes.add("cast_dtype")
    if has_conv and channels_last:
        passes.add("channels_last")
        return passes, "channels_last"
    return passes, "contiguous"
