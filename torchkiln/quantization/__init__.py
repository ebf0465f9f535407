"""Quantization: tk.quantize(model, scheme, calib_data=...) and the prepare/convert form.

Schemes (config.SCHEMES): int8-dynamic, int8-static, int8-smoothquant, int8-weight-only,
int4-weight-only, fp8. Built on torchao (quantize_ configs, the pt2e X86InductorQuantizer
flow), with torchkiln's own weight-only layers where torchao's were slower (weight_only.py);
see docs/quantization.md.
"""

from .accuracy import AccuracyReport
from .api import Prepared, QuantInfo, QuantizedGraph, convert, info, prepare, quantize
from .config import SCHEMES, QuantConfig
from .io import load, load_calibration, save, save_calibration
from .schemes import fast_schemes

__all__ = ["SCHEMES", "AccuracyReport", "Prepared", "QuantConfig", "QuantInfo", "QuantizedGraph", "convert",
           "fast_schemes", "info", "load", "load_calibration", "prepare", "quantize", "save", "save_calibration"]
