"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights, per input channel,
before static int8 quantization: y = (x / s) (W s)^T with s_j = max|x_j|^a / max|W_j|^(1-a).

Hand-written because torchao's SmoothQuantConfig feeds its own (torchao tensor-subclass)
int8 linear, which on CPU runs through ``torch._int_mm``'s reference kernel (schemes.py); here
the smoothed linear goes through the same pt2e/oneDNN flow as int8-static. The division is an
explicit multiply in front of each linear rather than folded into a preceding LayerNorm: it
works for any producer, and inductor fuses it into the activation's quantize kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import inputs
from .calibrate import layer_inputs


class SmoothedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, scale: torch.Tensor):
        super().__init__()
        self.linear = linear
        with torch.no_grad():
            linear.weight.mul_(scale.to(linear.weight.dtype))
        self.register_buffer("inv_scale", (1.0 / scale).to(linear.weight.dtype))

    def forward(self, x):
        return self.linear(x * self.inv_scale)


ROWS = 512  # activation rows kept per linear for the alpha search
GRID = (None, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # None: this linear is not smoothed


def activation_stats(model: nn.Module, data: list[inputs.Args], names: list[str], device, rows: int = 0):
    """Per input channel max |x| of each named linear over the calibration batches, and (``rows`` > 0)
    the first ``rows`` activation rows each one saw."""
    amax: dict[str, torch.Tensor] = {}
    kept: dict[str, list[torch.Tensor]] = {}

    def record(name, x):
        flat = x.reshape(-1, x.shape[-1]).float()
        cur = flat.abs().amax(0)
        amax[name] = torch.maximum(amax[name], cur) if name in amax else cur
        have = sum(len(t) for t in kept.get(name, []))
        if have < rows:
            kept.setdefault(name, []).append(flat[: rows - have].cpu())

    layer_inputs(model, names, data, device, record)
    return amax, {n: torch.cat(ts) for n, ts in kept.items()}


def _scale(amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w = weight.detach().abs().amax(0).float().clamp(min=1e-5)
    return (amax.clamp(min=1e-5).pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)


def _fake_act(x: torch.Tensor, fit: torch.Tensor | None = None) -> torch.Tensor:
    """Per-tensor affine uint8, its min/max range from ``fit`` (default ``x`` itself): the static
    flow's activation quantization. Values of ``x`` outside ``fit``'s range clip, as new inputs do."""
    fit = x if fit is None else fit
    lo, hi = min(float(fit.min()), 0.0), max(float(fit.max()), 0.0)
    scale = max(hi - lo, 1e-8) / 255
    zp = round(-lo / scale)
    return ((x / scale).round() + zp).clamp(0, 255).sub(zp).mul(scale)


def _fake_weight(w: torch.Tensor) -> torch.Tensor:
    """Per output channel symmetric int8: the static flow's weight quantization."""
    scale = (w.abs().amax(1, keepdim=True) / 127.5).clamp(min=1e-12)
    return (w / scale).round().clamp(-128, 127).mul(scale)


def choose_alpha(linear: nn.Linear, x: torch.Tensor, amax: torch.Tensor, grid=GRID,
                 held_out: bool = False) -> float | None:
    """The migration strength with the smallest output error of the int8 linear on the sampled
    activations ``x``, None (not smoothed) included. SmoothQuant's one alpha for every layer (0.5)
    is a compromise: on MiniLM it lost to plain static int8 (benchmarks/RESULTS.md); per layer the
    best of the grid can only match or beat leaving the layer alone, on these rows.

    ``held_out``: ``x`` is every calibration row, so ``amax`` and the activation range come from the
    very rows being scored and no clipping is ever seen; on small sets that picks alphas that fail on
    new rows (an MLP, 32 rows: 25.0 dB held-out against 36.4 unsmoothed). Then each alpha is scored
    on each half of the rows with the maxima and range of the other half, the two errors summed."""
    w = linear.weight.detach().float().cpu()
    x = x.float().cpu()
    if held_out:
        if len(x) < 4:  # too few rows to tell an alpha from noise: leave the layer alone
            return None
        a, b = x[: len(x) // 2], x[len(x) // 2:]
        folds = ((a, b, a.abs().amax(0)), (b, a, b.abs().amax(0)))  # (fit, scored, fit's maxima)
    else:
        folds = ((x, x, amax.cpu()),)
    refs = [score @ w.T for _, score, _ in folds]
    best, best_err = None, float("inf")
    for alpha in grid:
        err = 0.0
        for (fit, score, m), ref in zip(folds, refs, strict=True):
            s = torch.ones(w.shape[1]) if alpha is None else _scale(m, w, alpha)
            y = _fake_act(score / s, fit / s) @ _fake_weight(w * s).T
            err += float((y - ref).pow(2).mean())
        if err < best_err:
            best, best_err = alpha, err
    return best


def smooth(model: nn.Module, amax: dict[str, torch.Tensor], alpha) -> int:
    """Replace each linear with its smoothed form, in place (``model`` is torchkiln's copy). ``alpha``:
    one float for every linear, or a dict name -> float or None (None: left as it is)."""
    count = 0
    for name, a in amax.items():
        al = alpha.get(name) if isinstance(alpha, dict) else alpha
        if al is None:
            continue
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lin = getattr(owner, child)
        setattr(owner, child, SmoothedLinear(lin, _scale(a, lin.weight, al).to(lin.weight.device)))
        count += 1
    return count
