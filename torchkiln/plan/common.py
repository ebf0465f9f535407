"""Choices every device family starts from."""

from __future__ import annotations

import torch
from torch import nn

from ..passes import registry
from ..passes.channels_last import memory_format_for
from ..passes.global_avg_pool import has_avg_pool


def cast_pass(dtype: torch.dtype, islands: bool = True):
    """The cast to a low precision; ``islands=False`` keeps no modules in fp32 (a family whose
    norm and softmax kernels accumulate in fp32 already)."""
    return registry.make("cast_dtype", dtype=str(dtype).removeprefix("torch."),
                         **({} if islands else {"fp32_modules": ()}))


def base_passes(dtype: torch.dtype, model: nn.Module, channels_last: bool = True,
                islands: bool = True) -> tuple[list, str]:
    """The eager passes that pay everywhere (as configs), and the memory format: channels_last for
    2-D/3-D conv nets (a Conv1d-only model such as whisper's or wav2vec2's audio stem has no such layout)."""
    passes = [registry.make(n) for n in ("replace_dropout", "fold_conv_bn", "fold_linear_bn")]
    if has_avg_pool(model):  # a whole-input window compiles to a reduction over the window (global_avg_pool.py)
        passes.append(registry.make("global_avg_pool"))
    if dtype != torch.float32:
        passes.append(cast_pass(dtype, islands))
    if channels_last and memory_format_for(model) is not None:
        passes.append(registry.make("channels_last"))
        return passes, "channels_last"
    return passes, "contiguous"


def is_hf(model: nn.Module) -> bool:
    """A transformers model: its forward treats attention_mask=None as all ones."""
    return type(model).__module__.startswith("transformers.") and hasattr(model, "config")
