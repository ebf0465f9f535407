"""QuantConfig: one quantization decision as frozen, JSON-serialisable data.

The scheme names are the public vocabulary; which library flow runs them (torchao's
``quantize_`` or the pt2e ``X86InductorQuantizer``) is chosen per device by
``schemes.backend_for`` and recorded in the config, so a saved model loads the same way.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

SCHEMES = ("int8-dynamic", "int8-static", "int8-smoothquant", "int8-weight-only", "int4-weight-only", "fp8")
STATIC = ("int8-static", "int8-smoothquant")  # need calibration data
GROUP_SIZES = (32, 64, 128, 256)

# The accuracy bar auto_fallback enforces: the lowest SQNR (dB) of any floating output against
# fp32, on the evaluation inputs. 20 dB is a relative L2 error of 0.1; 30 dB, 0.03. Static int8
# quantizes activations with one calibrated range per tensor, so it gets a lower bar. Measured on
# all-MiniLM-L6-v2 (docs/quantization.md): int8-dynamic 0.992 cosine at ~22 dB, int8-static 0.994.
DEFAULT_MIN_SQNR = {"int8-dynamic": 20.0, "int8-static": 15.0, "int8-smoothquant": 15.0,
                    "int8-weight-only": 30.0, "int4-weight-only": 20.0, "fp8": 20.0}


@dataclass(frozen=True)
class QuantConfig:
    scheme: str
    backend: str = "auto"  # auto | torchao | pt2e | kernels (auto: schemes.backend_for(scheme, device))
    group_size: int = 128  # int4-weight-only: weights per scale
    # int8-smoothquant: migration strength (0: none, 1: all onto the weights), or "auto": chosen per linear
    # from smoothquant.GRID by the int8 output error on calibration rows (smoothquant.choose_alpha)
    alpha: float | str = "auto"
    min_sqnr: float | None = None  # None: DEFAULT_MIN_SQNR[scheme]
    auto_fallback: bool = True  # keep the layers that break min_sqnr in floating point
    keep: tuple[str, ...] = ()  # module names kept in floating point (the user's + auto_fallback's)
    max_keep_fraction: float = 0.5  # auto_fallback gives up beyond this share of the layers
    # weight-only schemes: choose the weights' rounding with the calibration inputs (gptq.py) instead of
    # rounding each to nearest; needs calib_data, runs on torchkiln's weight-only layers (backend "kernels").
    # None: on for int4-weight-only when calibration data is given (MiniLM g32: 0.9739 -> 0.9960 cosine),
    # off for int8-weight-only, whose nearest rounding already reaches 0.9997 there
    gptq: bool | None = None

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme={self.scheme!r} is not a quantization scheme; use one of {', '.join(SCHEMES)}")
        if self.backend not in ("auto", "torchao", "pt2e", "kernels"):
            raise ValueError(f"backend={self.backend!r} is not one of 'auto', 'torchao', 'pt2e', 'kernels'")
        if self.backend == "kernels" and not self.scheme.endswith("-weight-only"):
            raise ValueError(f"backend='kernels' serves int8-weight-only and int4-weight-only only, not "
                             f"{self.scheme!r}; use backend='auto'")
        if self.scheme == "int4-weight-only" and self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size!r} is not supported for int4-weight-only; use one of "
                             f"{GROUP_SIZES}")
        if self.alpha != "auto" and not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ValueError(f"alpha={self.alpha!r} must be 'auto' (chosen per layer, the default) or a number "
                             "between 0 and 1 (0.5 is the SmoothQuant paper's)")
        if self.gptq and not self.scheme.endswith("-weight-only"):
            raise ValueError(f"gptq=True chooses the rounding of weight-only schemes (int8-weight-only, "
                             f"int4-weight-only), not {self.scheme!r}; drop gptq or pick one of those")
        if self.gptq and self.backend not in ("auto", "kernels"):
            raise ValueError(f"gptq=True builds torchkiln's weight-only layers (backend 'kernels'), not "
                             f"backend={self.backend!r}; use backend='auto'")
        if self.min_sqnr is not None and (isinstance(self.min_sqnr, bool) or
                                          not isinstance(self.min_sqnr, (int, float)) or self.min_sqnr != self.min_sqnr):
            raise ValueError(f"min_sqnr={self.min_sqnr!r} must be a number of dB (higher is stricter; the default "
                             f"for {self.scheme} is {DEFAULT_MIN_SQNR[self.scheme]:g}) or None for that default")
        for name in ("auto_fallback",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.max_keep_fraction, (int, float)) or not 0.0 <= self.max_keep_fraction <= 1.0:
            raise ValueError(f"max_keep_fraction={self.max_keep_fraction!r} must be between 0 and 1")
        object.__setattr__(self, "keep", tuple(self.keep))

    @property
    def static(self) -> bool:
        return self.scheme in STATIC

    @property
    def needs_calibration(self) -> bool:
        return self.static or self.gptq

    @property
    def threshold(self) -> float:
        return DEFAULT_MIN_SQNR[self.scheme] if self.min_sqnr is None else float(self.min_sqnr)

    def replace(self, **changes) -> QuantConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["keep"] = list(self.keep)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown QuantConfig fields {sorted(unknown)}; known: {sorted(names)}")
        return cls(**{**d, "keep": tuple(d.get("keep", ()))})


def make(scheme, **options) -> QuantConfig:
    """A QuantConfig from a scheme name (or a config, with options replaced)."""
    if isinstance(scheme, QuantConfig):
        return scheme.replace(**options) if options else scheme
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a string (one of {', '.join(SCHEMES)}) or a QuantConfig, "
                        f"got {type(scheme).__name__}")
    names = {f.name for f in dataclasses.fields(QuantConfig)} - {"scheme"}
    unknown = set(options) - names
    if unknown:
        raise TypeError(f"unknown quantization option(s) {sorted(unknown)}; known: {sorted(names)}")
    return QuantConfig(scheme, **options)
