"""GPTQ: weight-only rounding chosen with the calibration inputs (Frantar et al., 2022).

Plain rounding (RTN) picks each weight's nearest grid value. GPTQ quantizes a layer's input
columns one at a time and moves each column's rounding error onto the columns not yet quantized,
weighted by the inverse of the inputs' second moment H = E[x xᵀ], so that X Wᵀ, not W, stays
close. On the real all-MiniLM-L6-v2, int4 with groups of 32 went from 0.9739 mean cosine (RTN) to
0.9960, 0.9935 on sentences outside the calibration set (benchmarks/RESULTS.md, "GPTQ").

Hand-written because torchao's GPTQ (torchao.prototype.gptq, 0.18) runs on CUDA only and needs
the mslk package for int4; this one runs wherever the model does and produces the codes of
weight_only.py's layers (asymmetric int4 groups, symmetric per-channel int8) directly, so the
saved file and the kernels are the ones plain rounding uses.

Choices, measured on MiniLM at g32 (all / held-out sentences): columns in decreasing order of
H's diagonal ("act order") with each group's scale and zero taken from the original weights
("static groups"), 0.9960 / 0.9935, against 0.9947 / 0.9922 in input order with grids from the
updated weights. Collecting H from a model quantized layer by layer ("sequential") gave
0.9960 / 0.9937 for 37 calibration passes instead of one, so H comes from the float model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import inputs
from .._log import warn_once
from ..progress import ticks
from .accuracy import padding_mask
from .calibrate import layer_inputs
from .weight_only import int4_grid, int8_scales

DAMP = 0.01  # added to H's diagonal, as a share of its mean (the paper's 1%)
BLOCK = 128  # columns whose updates are applied lazily, together (the paper's batching)
HESSIAN_BYTES = 1 << 30  # H matrices collected per calibration pass (Llama-3-8B's down_proj: 0.8 GB)

# quant(columns, x) -> (codes, dequantized): rounds the columns ``columns`` (original indices) of
# one layer whose current values are ``x`` [n, len(columns)]
Quantizer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def hessians(model: nn.Module, names: list[str], data: list[inputs.Args], device,
             short: list | None = None) -> dict[str, torch.Tensor]:
    """E[x xᵀ] of each named Linear's input over ``data``, run through the float ``model``;
    positions a batch's ``attention_mask`` marks as padding are left out. A layer with fewer input
    rows than inputs gets the identity instead, listed in ``short`` as (name, rows, inputs)."""
    acc: dict[str, torch.Tensor] = {}
    rows = dict.fromkeys(names, 0)
    for batch in data:
        mask = padding_mask(batch)

        def add(name, x, mask=mask):
            if mask is not None and x.dim() >= 3 and tuple(x.shape[:2]) == tuple(mask.shape):
                x = x[mask.to(x.device)]
            x = x.reshape(-1, x.shape[-1]).float()
            if name not in acc:  # sized by the input (transformers' Conv1D has no in_features)
                acc[name] = torch.zeros(x.shape[-1], x.shape[-1], device=x.device)
            acc[name].addmm_(x.T, x)
            rows[name] += x.shape[0]

        layer_inputs(model, names, [batch], device, add)
    missing = [n for n in names if n not in acc]
    if missing:
        raise ValueError(f"GPTQ: the calibration data never reached {missing[:3]}; pass batches that run the whole model")
    for n in names:
        k = acc[n].shape[0]
        if rows[n] < k:
            # Fewer input rows than input features: H is singular, and GPTQ fits its rounding to those rows.
            # An MLP's 64-input layer calibrated on 32 rows read 18.4 dB SQNR on held-out rows against
            # nearest rounding's 20.5 (22.5 vs 20.5 at 256 rows; a new-user probe, thirty-seventh session).
            # An identity H makes GPTQ's solve plain nearest rounding (no error is carried across columns).
            if short is not None:
                short.append((n, rows[n], k))
            acc[n] = torch.eye(k, device=acc[n].device) * rows[n]
    return {n: acc[n] / rows[n] for n in names}


def solve(weight: torch.Tensor, h: torch.Tensor, quant: Quantizer) -> torch.Tensor:
    """GPTQ's codes for ``weight`` [n, k] given its inputs' second moment ``h`` [k, k]."""
    w = weight.detach().float().clone()
    h = h.float().clone()
    k = w.shape[1]
    dead = torch.diag(h) == 0  # inputs that were always zero: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    h.diagonal().add_(DAMP * float(torch.diag(h).mean()))
    # the upper Cholesky factor of H⁻¹: row i holds column i's error-propagation weights
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = None
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        block, hb = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        errs = torch.zeros_like(block)
        for i in range(i2 - i1):
            q, dq = quant(order[i1 + i: i1 + i + 1], block[:, i:i + 1])
            if codes is None:
                codes = torch.empty(w.shape, dtype=q.dtype, device=w.device)
            codes[:, order[i1 + i]] = q[:, 0]
            err = (block[:, i] - dq[:, 0]) / hb[i, i]
            block[:, i:] -= err[:, None] * hb[i, i:][None, :]
            errs[:, i] = err
        w[:, i2:] -= errs @ hinv[i1:i2, i2:]
    return codes


def int4(weight: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 codes 0-15 on the fixed grid ``w = q * scale + lo`` ([n, k // group] each)."""
    s, z = scale.float(), lo.float()

    def quant(cols, x):
        g = cols // group
        q = ((x - z[:, g]) / s[:, g]).round().clamp(0, 15)
        return q.to(torch.uint8), q * s[:, g] + z[:, g]

    return solve(weight, h, quant)


def int8(weight: torch.Tensor, h: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-127, 127] on the fixed per-output-channel grid ``w = q * scales``."""
    s = scales.float()[:, None]

    def quant(cols, x):
        q = (x / s).round().clamp(-127, 127)
        return q.to(torch.int8), q * s

    return solve(weight, h, quant)


def layer_codes(weight: torch.Tensor, h: torch.Tensor, scheme: str, group: int) -> tuple:
    """The codes weight_only.py's layer takes (``Int8Linear(codes=)`` / ``Int4Linear(codes=)``)."""
    if scheme == "int4-weight-only":
        scale, lo = int4_grid(weight, group)
        return int4(weight, h, scale, lo, group), scale, lo
    scales = int8_scales(weight)
    return int8(weight, h, scales), scales


def codes_for(model: nn.Module, names: list[str], scheme: str, group: int | dict[str, int], data: list[inputs.Args],
              device, show: bool = True, weights: dict[str, torch.Tensor] | None = None,
              short: list | None = None) -> dict[str, tuple]:
    """name -> layer_codes for each named module of the float ``model``, whose input H is collected
    over ``data``. ``weights``: name -> the weight to quantize against that input (default: the
    module's own; the LLM path passes its fused projections); ``group``: one, or per name. H is
    collected for as many layers per calibration pass as fit in HESSIAN_BYTES. ``short`` (a list) gets
    (name, rows, inputs) of each layer rounded to nearest for want of calibration rows."""
    mods = dict(model.named_modules())
    weights = weights or {n: mods[n].weight for n in names}
    out: dict[str, tuple] = {}
    chunks, cur, size = [], [], 0
    for n in names:
        b = 4 * weights[n].shape[1] ** 2
        if cur and size + b > HESSIAN_BYTES:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    if cur:
        chunks.append(cur)
    short = [] if short is None else short
    with ticks(show, "GPTQ", len(names)) as tick, torch.no_grad():
        for chunk in chunks:
            hs = hessians(model, chunk, data, device, short)
            for n in chunk:
                g = group[n] if isinstance(group, dict) else group
                out[n] = layer_codes(weights[n].detach().to(device), hs.pop(n), scheme, g)
                if tick is not None:
                    tick()
    if short:
        n, r, k = short[0]
        warn_once(f"gptq-short:{n}:{r}", f"torchkiln: GPTQ needs at least as many calibration rows (tokens) as a "
                  f"layer has inputs; {len(short)} layer(s) got fewer ({n}: {r} rows, {k} inputs) and are rounded "
                  "to nearest instead (fitted to too few rows, GPTQ's rounding was worse on other inputs). Pass "
                  "more calib_data for GPTQ there")
    return out
