"""The accuracy report every quantized model gets: each floating output against fp32.

SQNR (dB) = 10 log10(sum ref^2 / sum (ref - q)^2), pooled over the evaluation batches per
output position; cosine similarity along the last dimension (mean over rows), for outputs with
at least two dimensions; argmax agreement for logits (guard.py's rule: an HF ``logits`` field or
a 2-D output). Positions an input batch marks as padding (a 2-D ``attention_mask`` keyword,
transformers' convention) are left out of every output whose leading dims are (batch, sequence):
no consumer reads them, and counting them made a padded encoder batch read 22 dB where its
embeddings kept a 0.9999 cosine (all-MiniLM-L6-v2 int8-weight-only; auto_fallback then kept 18
of 37 linears for nothing).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch

from ..guard import _logit_paths
from ..inputs import flatten


@dataclass(frozen=True)
class OutputAccuracy:
    index: int
    sqnr_db: float
    cosine: float | None = None
    argmax_agree: float | None = None


@dataclass
class AccuracyReport:
    scheme: str
    backend: str
    threshold_db: float
    batches: int  # evaluation batches compared
    outputs: list[OutputAccuracy] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # modules kept in floating point
    auto_kept: list[str] = field(default_factory=list)  # of those, the ones auto_fallback chose
    quantized: int = 0  # modules quantized
    notes: list[str] = field(default_factory=list)
    measured_on: str = ""  # which batches the outputs were measured on (eval_data, calibration batches, ...)

    @property
    def min_sqnr(self) -> float:
        return min((o.sqnr_db for o in self.outputs), default=math.inf)

    @property
    def passed(self) -> bool:
        return self.min_sqnr >= self.threshold_db

    def to_dict(self) -> dict:
        d = asdict(self)
        d["min_sqnr_db"] = self.min_sqnr
        d["passed"] = self.passed
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"{self.scheme} via {self.backend}: {self.quantized} layers quantized, {len(self.kept)} kept in "
                 f"floating point; accuracy against fp32 on {self.batches} batch(es)"
                 f"{f' ({self.measured_on})' if self.measured_on else ''}, "
                 f"{'PASSED' if self.passed else 'BELOW'} the {self.threshold_db:g} dB bar"]
        for o in self.outputs:
            extra = (f", cosine {o.cosine:.4f}" if o.cosine is not None else "") + \
                    (f", argmax agreement {o.argmax_agree:.1%}" if o.argmax_agree is not None else "")
            lines.append(f"  output [{o.index}]: SQNR {o.sqnr_db:.1f} dB{extra}")
        if self.kept:
            lines.append("  kept in floating point: " + ", ".join(
                k + (" (auto)" if k in self.auto_kept else "") for k in self.kept))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def sqnr(ref: torch.Tensor, q: torch.Tensor) -> float:
    ref, q = ref.detach().double().cpu(), q.detach().double().cpu()
    noise = float((ref - q).pow(2).sum())
    signal = float(ref.pow(2).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def padding_mask(batch) -> torch.Tensor | None:
    """The real (non-padding) positions of an input batch ``(args, kwargs)``: its 2-D
    ``attention_mask`` keyword as bool, else None."""
    kwargs = batch[1] if isinstance(batch, tuple) and len(batch) == 2 else None
    mask = kwargs.get("attention_mask") if isinstance(kwargs, dict) else None
    return mask.detach().cpu().bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def _real(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``t`` without its padding positions, where its leading dims are the mask's (batch, seq)."""
    if mask is None or t.dim() < 2 or tuple(t.shape[:2]) != tuple(mask.shape):
        return t
    return t[mask]


def measure(refs: list, outs: list, masks: list | None = None) -> list[OutputAccuracy]:
    """Per floating output position, pooled over batches (refs[i] and outs[i]: one batch;
    masks[i]: its padding_mask, or None)."""
    if not refs:
        return []
    kinds = _logit_paths(refs[0])
    per: dict[int, dict[str, list]] = {}
    for n, (ref, out) in enumerate(zip(refs, outs, strict=True)):
        mask = masks[n] if masks else None
        r, o = flatten(ref), flatten(out)
        if len(r) != len(o):
            raise RuntimeError(f"the quantized model returns {len(o)} tensors where the original returns {len(r)}")
        for i, (a, b) in enumerate(zip(r, o, strict=True)):
            if not a.is_floating_point():
                continue
            if a.shape != b.shape:
                raise RuntimeError(f"output [{i}] has shape {tuple(b.shape)}, the original {tuple(a.shape)}")
            d = per.setdefault(i, {"ref": [], "q": [], "logits": kinds[i] if i < len(kinds) else False})
            d["ref"].append(_real(a.detach().float().cpu(), mask))
            d["q"].append(_real(b.detach().float().cpu(), mask))
    result = []
    for i, d in per.items():
        ref, q = torch.cat([t.flatten() for t in d["ref"]]), torch.cat([t.flatten() for t in d["q"]])
        cos = agree = None
        if d["ref"][0].dim() >= 2 and d["ref"][0].shape[-1] > 1:
            rows_r = torch.cat([t.reshape(-1, t.shape[-1]) for t in d["ref"]])
            rows_q = torch.cat([t.reshape(-1, t.shape[-1]) for t in d["q"]])
            cos = float(torch.nn.functional.cosine_similarity(rows_r.double(), rows_q.double(), dim=-1).mean())
            if d["logits"]:
                agree = float((rows_r.argmax(-1) == rows_q.argmax(-1)).double().mean())
        result.append(OutputAccuracy(i, round(sqnr(ref, q), 3), cos, agree))
    return result
