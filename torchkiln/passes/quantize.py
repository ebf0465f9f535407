"""The quantization pass: the scheme a model was quantized with, in the Recipe.

Quantization needs calibration data, so ``tk.quantize`` runs before the candidates are
built (every candidate, stock ones included, then serves the same quantized model, and the
guard compares them with it). This pass records the decision in the recipe and the report;
it checks that the model it receives is the one the recipe describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .registry import Skip, register


@dataclass(frozen=True)
class QuantizeConfig:
    name: ClassVar[str] = "quantize"
    scheme: str = "int8-static"
    backend: str = "pt2e"
    kept: tuple[str, ...] = ()  # modules left in floating point
    min_sqnr_db: float | None = None  # the accuracy report's worst output against fp32


@register(QuantizeConfig, order=1)
def _apply(model, config: QuantizeConfig, ctx):
    qi = getattr(model, "kiln_quant", None)
    if qi is None or qi.config.scheme != config.scheme:
        raise Skip(f"the model is not quantized with {config.scheme} (use tk.quantize first)")
    sqnr = f", worst output {config.min_sqnr_db:.1f} dB vs fp32" if config.min_sqnr_db is not None else ""
    return model, f"{config.scheme} via {config.backend}, {qi.report.quantized} layers, {len(config.kept)} kept{sqnr}"
