"""SmoothQuant's per-layer alpha search (alpha="auto")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchkiln.quantization import QuantConfig
from torchkiln.quantization import smoothquant as sq


def reference_error(lin: nn.Linear, x: torch.Tensor, amax: torch.Tensor, alpha) -> float:
    """The int8 linear's output error, through torch's own fake-quantize ops (not the module's)."""
    w = lin.weight.detach()
    if alpha is None:
        s = torch.ones(w.shape[1])
    else:
        s = (amax.clamp(min=1e-5) ** alpha / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
    xs, ws = x / s, w * s
    lo, hi = min(float(xs.min()), 0.0), max(float(xs.max()), 0.0)
    scale = (hi - lo) / 255
    xq = torch.fake_quantize_per_tensor_affine(xs, scale, round(-lo / scale), 0, 255)
    wscale = ws.abs().amax(1) / 127.5
    wq = torch.fake_quantize_per_channel_affine(ws, wscale, torch.zeros(len(wscale), dtype=torch.int32), 0, -128, 127)
    return float((xq @ wq.T - x @ w.T).pow(2).mean())


def test_auto_alpha_is_the_grids_argmin_and_moves_an_outlier_channel():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(256, 64)
    x[:, 5] *= 60.0  # one activation channel with outliers: what SmoothQuant is for
    amax = x.abs().amax(0)
    errors = {a: reference_error(lin, x, amax, a) for a in sq.GRID}
    chosen = sq.choose_alpha(lin, x, amax)
    assert chosen is not None  # smoothing beats leaving the outlier in the activation's range
    assert errors[chosen] <= min(errors.values()) * 1.05, (chosen, errors)
    assert errors[chosen] < 0.5 * errors[None]


def test_without_outliers_smoothing_may_be_declined():
    torch.manual_seed(1)
    lin = nn.Linear(64, 32)
    x = torch.randn(256, 64)
    amax = x.abs().amax(0)
    errors = {a: reference_error(lin, x, amax, a) for a in sq.GRID}
    assert errors[sq.choose_alpha(lin, x, amax)] <= min(errors.values()) * 1.05


def test_alpha_must_be_auto_or_a_fraction():
    assert QuantConfig("int8-smoothquant").alpha == "auto"
    assert QuantConfig("int8-smoothquant", alpha=0.5).alpha == 0.5
    for bad in (1.5, "best", None):
        with pytest.raises(ValueError, match="alpha="):
            QuantConfig("int8-smoothquant", alpha=bad)
