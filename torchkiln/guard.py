"""Numeric comparison of two model outputs: the optimized model against the
fp32 eager original (and, in check(), any two runs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .inputs import flatten


@dataclass(frozen=True)
class Error:
    max_abs: float
    rel: float  # ||a - b|| / ||b|| over all floating outputs
    argmax_agree: float | None = None  # for classifier-like (N, C) outputs
    shapes_match: bool = True

    def ok(self, tolerance: float) -> bool:
        return self.shapes_match and math.isfinite(self.rel) and self.rel <= tolerance

    def to_dict(self) -> dict:
        return {"max_abs": self.max_abs, "rel": self.rel, "argmax_agree": self.argmax_agree,
                "shapes_match": self.shapes_match}

    def __str__(self) -> str:
        s = f"max_abs={self.max_abs:.3g} rel={self.rel:.3g}"
        return s + (f" argmax_agree={self.argmax_agree:.1%}" if self.argmax_agree is not None else "")


def compare(out, ref) -> Error:
    a, b = flatten(out), flatten(ref)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=False)):
        return Error(math.inf, math.inf, None, shapes_match=False)
    pairs = [(x.detach().double().cpu(), y.detach().double().cpu())
             for x, y in zip(a, b, strict=True) if y.is_floating_point()]
    exact = [(x, y) for x, y in zip(a, b, strict=True) if not y.is_floating_point()]
    if any(not torch.equal(x.cpu(), y.cpu()) for x, y in exact):
        return Error(math.inf, math.inf, None)
    if not pairs:
        return Error(0.0, 0.0)
    diff = sum(float((x - y).pow(2).sum()) for x, y in pairs)
    norm = sum(float(y.pow(2).sum()) for _, y in pairs)
    max_abs = max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in pairs)
    if any(not torch.isfinite(x).all() for x, _ in pairs):
        return Error(math.inf, math.inf, None)
    rel = math.sqrt(diff) / math.sqrt(norm) if norm > 0 else math.sqrt(diff)
    x0, y0 = pairs[0]
    agree = None
    if y0.dim() == 2 and y0.shape[1] > 1:
        agree = float((x0.argmax(-1) == y0.argmax(-1)).double().mean())
    return Error(max_abs, rel, agree)


def compare_each(out, ref) -> list[Error]:
    """One Error per output tensor (flattened order), for per-output reports."""
    a, b = flatten(out), flatten(ref)
    if len(a) != len(b):
        return [Error(math.inf, math.inf, None, shapes_match=False)]
    return [compare(x, y) for x, y in zip(a, b, strict=True)]
