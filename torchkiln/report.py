"""The record optimize() leaves on the model: what was applied, what fell back
and why, how long it took, and the measured error."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Fallback:
    step: str  # what was abandoned
    to: str  # what is used instead
    reason: str


@dataclass
class Report:
    recipe: dict
    applied: list[str] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    optimize_seconds: float | None = None
    first_call_seconds: float | None = None  # includes compilation
    error: dict | None = None  # vs fp32 eager, from the numeric guard
    tolerance: float | None = None
    active: str = "pending first call"  # which step of the chain serves calls

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def __str__(self) -> str:
        r = self.recipe
        lines = [f"torchkiln report: {r['device']} {r['level']} {r['dtype']} -> serving: {self.active}"]
        lines.append(f"  applied    {', '.join(self.applied) or '-'}")
        opts = ", ".join(f"{k}={v}" for k, v in r["compile_options"].items())
        lines.append(f"  compile    {'inductor ' + opts if r['compile'] else 'off'}")
        for f in self.fallbacks:
            lines.append(f"  FALLBACK   {f.step} -> {f.to}: {f.reason}")
        if self.error is not None:
            e = self.error
            agree = f", argmax agreement {e['argmax_agree']:.1%}" if e.get("argmax_agree") is not None else ""
            lines.append(f"  error      rel {e['rel']:.3g} (tolerance {self.tolerance:g}), "
                         f"max abs {e['max_abs']:.3g}{agree}")
        t = [f"optimize {self.optimize_seconds:.2f} s" if self.optimize_seconds is not None else None,
             f"first call {self.first_call_seconds:.2f} s" if self.first_call_seconds is not None else None]
        lines.append("  time       " + ", ".join(x for x in t if x))
        lines += [f"  why        {n}" for n in r.get("notes", ())]
        return "\n".join(lines)
