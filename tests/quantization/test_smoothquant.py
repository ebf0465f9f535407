"""SmoothQuant's per-layer alpha search (alpha="auto")."""

from __future__ import annotations

import needs
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


def held_out_error(lin: nn.Linear, calib: torch.Tensor, new: torch.Tensor, alpha) -> float:
    """The int8 linear's error on rows it was not calibrated on: maxima and activation range from
    ``calib``, new rows clipped to that range (torch's fake-quantize clamps), as a deployed model sees."""
    w = lin.weight.detach()
    amax = calib.abs().amax(0)
    s = torch.ones(w.shape[1]) if alpha is None else (
        amax.clamp(min=1e-5) ** alpha / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
    lo, hi = min(float((calib / s).min()), 0.0), max(float((calib / s).max()), 0.0)
    scale = (hi - lo) / 255
    xq = torch.fake_quantize_per_tensor_affine(new / s, scale, round(-lo / scale), 0, 255)
    ws = w * s
    wscale = ws.abs().amax(1) / 127.5
    wq = torch.fake_quantize_per_channel_affine(ws, wscale, torch.zeros(len(wscale), dtype=torch.int32), 0, -128, 127)
    return float((xq @ wq.T - new @ w.T).pow(2).mean())


def test_few_rows_are_scored_held_out_and_do_not_pick_an_alpha_that_fails_new_rows():
    # 24 Gaussian rows: each channel's maximum is a noisy estimate, and in-sample scoring (the maxima
    # and range from the scored rows themselves, nothing ever clipped) prefers an alpha that new rows
    # punish. Scored held out, the choice must do about as well on new rows as the grid's best there.
    worse = 0
    for seed in range(6):
        torch.manual_seed(seed)
        lin = nn.Linear(64, 32)
        calib, new = torch.randn(24, 64), torch.randn(4096, 64)
        errors = {a: held_out_error(lin, calib, new, a) for a in sq.GRID}
        chosen = sq.choose_alpha(lin, calib, calib.abs().amax(0), held_out=True)
        in_sample = sq.choose_alpha(lin, calib, calib.abs().amax(0))
        assert errors[chosen] <= 1.5 * min(errors.values()), (seed, chosen, errors)
        worse += errors[in_sample] > errors[chosen]
    assert worse >= 3  # the held-out score is what fixes these cases (in-sample chose worse in most)


def test_too_few_rows_leave_the_layer_alone():
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    x[:, 0] *= 50.0
    assert sq.choose_alpha(lin, x, x.abs().amax(0), held_out=True) is None
    assert sq.choose_alpha(lin, x, x.abs().amax(0)) is not None  # in sample it would smooth that outlier


def test_held_out_scoring_still_smooths_a_real_outlier_channel():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(64, 64)
    x[:, 5] *= 60.0
    new = torch.randn(4096, 64)
    new[:, 5] *= 60.0
    errors = {a: held_out_error(lin, x, new, a) for a in sq.GRID}
    chosen = sq.choose_alpha(lin, x, x.abs().amax(0), held_out=True)
    # new rows' outliers beyond the 64 rows' maximum clip whatever alpha is, so smoothing gains less
    # than in sample (0.097 against 0.130 unsmoothed at best here), but it must still be taken
    assert chosen is not None
    assert errors[chosen] <= 1.05 * min(errors.values()) and errors[chosen] < 0.8 * errors[None], (chosen, errors)


@needs.pt2e
def test_quantize_with_a_small_calibration_set_is_no_worse_than_int8_static():
    # An MLP calibrated on 32 rows: the in-sample alpha search chose 0.9/0.2/0.4 and reached 25.0 dB on new
    # rows against int8-static's 36.4 (benchmarks/RESULTS.md); scored held out it must not lose to static.
    import torchkiln as tk

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16)).eval()
    g = torch.Generator().manual_seed(9)
    new = torch.randn(128, 64, generator=g)
    calib = [torch.randn(8, 64, generator=g) for _ in range(4)]
    with torch.no_grad():
        ref = m(new)

    def sqnr(scheme):
        q = tk.quantize(m, scheme, calib_data=calib, progress=False, auto_fallback=False)
        with torch.no_grad():
            err = q(new) - ref
        return float(10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum()))

    assert sqnr("int8-smoothquant") >= sqnr("int8-static") - 1.0
