"""Cast a model to a low-precision dtype, keeping numerically sensitive modules
(norms, softmax, losses) in fp32 behind a small wrapper that upcasts their
inputs and casts their outputs back. Under torch.compile the casts fuse into the
neighbouring kernels, so the islands cost almost nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .registry import register
from .tensors import floating, remake

# Module classes (by name, so transformers' own norms match without importing it)
# that stay fp32. Mirrors autocast's fp32 list at module granularity.
DEFAULT_FP32_MODULES = (
    "LayerNorm",
    "GroupNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LocalResponseNorm",
    "Softmax",
    "LogSoftmax",
    "*RMSNorm",
    "*Loss",
)


def _matches(cls_name: str, patterns) -> bool:
    return any(cls_name.endswith(p[1:]) if p.startswith("*") else cls_name == p for p in patterns)


class Fp32Island(nn.Module):
    """Runs ``module`` in fp32 inside a low-precision model."""

    def __init__(self, module: nn.Module, out_dtype: torch.dtype):
        super().__init__()
        # New fp32 tensors: module.float() would rewrite param.data in place, and the
        # parameters may be shared with the caller's (half-precision) model.
        self.module = remake(module, floating(lambda t: t.float()))
        self.out_dtype = out_dtype

    def __getattr__(self, name: str):
        # Parents may read their children's attributes (nn.TransformerEncoderLayer's fast path
        # reads norm1.weight and norm1.eps): an island answers for the module it wraps.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def forward(self, *args, **kwargs):
        up = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        out = self.module(*up, **kwargs)
        if torch.is_tensor(out) and out.is_floating_point():
            return out.to(self.out_dtype)
        return out


def cast_dtype(model: nn.Module, dtype: torch.dtype, fp32_modules=DEFAULT_FP32_MODULES) -> nn.Module:
    if dtype == torch.float32:
        return model
    _wrap(model, dtype, tuple(fp32_modules))
    return model


def _wrap(module: nn.Module, dtype, patterns) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, Fp32Island):
            continue
        if _matches(type(child).__name__, patterns):
            setattr(module, name, Fp32Island(child, dtype))
        else:
            _wrap(child, dtype, patterns)
    # Cast only this module's own tensors: islands keep theirs.
    remake(module, floating(lambda t: t.to(dtype)), recurse=False)


@dataclass(frozen=True)
class CastDtypeConfig:
    name: ClassVar[str] = "cast_dtype"
    dtype: str = "bfloat16"
    fp32_modules: tuple[str, ...] = DEFAULT_FP32_MODULES  # class names (``*Suffix`` matches a suffix)


@register(CastDtypeConfig, order=50)
def _apply(model, config, ctx):
    dtype = getattr(torch, config.dtype)
    model = cast_dtype(model, dtype, config.fp32_modules)
    islands = sum(isinstance(m, Fp32Island) for m in model.modules())
    return model, f"{config.dtype}, {islands} modules kept fp32"
