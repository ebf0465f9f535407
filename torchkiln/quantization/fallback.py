"""Which layers to keep in floating point when a scheme misses its accuracy bar.

Each candidate layer's own error is measured on the float model: its input is captured
on a calibration batch, and its output recomputed with the scheme's rounding simulated
(weights per output channel or per group, activations per tensor or per token). Layers are
then kept worst-first, doubling the count (1, 2, 4, ...) until the whole model passes, so a
model with L layers is re-quantized at most log2(L) times. Simulated rather than read from
the quantized model because the pt2e graph no longer has per-module boundaries to hook.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .. import inputs
from .accuracy import sqnr
from .calibrate import layer_inputs
from .config import QuantConfig

_STATIC_KINDS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def targets(model: nn.Module, config: QuantConfig, backend: str) -> list[str]:
    """Names of the modules the scheme quantizes (before ``keep``)."""
    kinds = _STATIC_KINDS if backend == "pt2e" else (nn.Linear,)
    names = []
    for name, m in model.named_modules():
        if not isinstance(m, kinds) or not name:
            continue
        # int4 kernels pack K in groups and N in tiles of 16 (_convert_weight_to_int4pack_cpu)
        if config.scheme == "int4-weight-only" and (m.in_features % config.group_size or m.out_features % 16):
            continue
        names.append(name)
    return names


def _fake_int(t: torch.Tensor, bits: int, dim_groups: tuple[int, ...]) -> torch.Tensor:
    """Symmetric fake quantization with one scale per group of the last dim(s) kept in ``dim_groups``."""
    q = 2 ** (bits - 1) - 1
    amax = t.abs().amax(dim=dim_groups, keepdim=True).clamp(min=1e-8)
    return (t / amax * q).round().clamp(-q, q) * amax / q


def _weight(w: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    w = w.float()
    if config.scheme == "int4-weight-only":
        g = config.group_size
        grouped = w.reshape(w.shape[0], -1, g)
        lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)  # asymmetric, as tinygemm's int4
        return (((grouped - lo) / scale).round().clamp(0, 15) * scale + lo).reshape(w.shape)
    if config.scheme == "fp8":
        amax = w.abs().amax(1, keepdim=True).clamp(min=1e-8)
        return (w / amax * 448).to(torch.float8_e4m3fn).float() * amax / 448
    return _fake_int(w, 8, tuple(range(1, w.dim())))  # int8 per output channel


def _activation(x: torch.Tensor, config: QuantConfig, backend: str, rng: tuple[float, float] | None) -> torch.Tensor:
    s = config.scheme
    if s.endswith("weight-only"):
        return x
    if s == "fp8":
        amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-8)
        return (x / amax * 448).to(torch.float8_e4m3fn).float() * amax / 448
    if s == "int8-dynamic" and backend == "torchao":  # per token, symmetric
        return _fake_int(x, 8, (-1,))
    lo, hi = rng if rng is not None else (float(x.min()), float(x.max()))  # per tensor, affine uint8
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max((hi - lo) / 255, 1e-8)
    zp = round(-lo / scale)
    return ((x / scale).round() + zp).clamp(0, 255).sub(zp) * scale


def sensitivity(model: nn.Module, config: QuantConfig, backend: str, data: list[inputs.Args], device,
                names: list[str]) -> dict[str, float]:
    """Each named layer's output SQNR (dB) under the scheme's simulated rounding; lower is worse."""
    mods = dict(model.named_modules())
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    layer_inputs(model, names, data, device, lambda n, x: seen[n].append(x.float()))
    out = {}
    with torch.no_grad():
        for n in names:
            m, xs = mods[n], seen[n]
            if not xs:
                continue
            rng = (min(float(x.min()) for x in xs), max(float(x.max()) for x in xs)) if config.static else None
            w = _weight(m.weight, config)
            b = m.bias.float() if m.bias is not None else None
            ys, yq = [], []
            for x in xs:
                xq = _activation(x, config, backend, rng)
                if isinstance(m, nn.Linear):
                    ys.append(F.linear(x, m.weight.float(), b))
                    yq.append(F.linear(xq, w, b))
                else:
                    ys.append(m._conv_forward(x, m.weight.float(), b))
                    yq.append(m._conv_forward(xq, w, b))
            out[n] = sqnr(torch.cat([y.flatten() for y in ys]), torch.cat([y.flatten() for y in yq]))
    return out


def keep_steps(ranked: list[str], max_keep: int) -> list[list[str]]:
    """The layer sets auto_fallback tries: the worst 1, 2, 4, ... up to ``max_keep``."""
    steps, k = [], 1
    while k <= max_keep:
        steps.append(ranked[:k])
        if k == max_keep:
            break
        k = min(2 * k, max_keep)
    return steps


def ranked(sens: dict[str, float]) -> list[str]:
    return sorted(sens, key=lambda n: (sens[n] if math.isfinite(sens[n]) else math.inf))
