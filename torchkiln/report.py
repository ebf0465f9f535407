"""The record optimize() leaves on the model: the candidates it measured and the
one it serves, the passes that ran, what fell back and why, how long it took,
and the numeric guard's verdict."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Fallback:
    step: str  # what was abandoned
    to: str  # what is used instead
    reason: str


@dataclass
class Measurement:
    """One candidate: how it fared against the guard and the clock."""

    name: str
    kind: str  # torchkiln | stock | eager | original
    dtype: str
    status: str = "not run"  # served | passed | failed | skipped (no host memory to build it) | not run
    median_ms: float | None = None
    calls_timed: int = 0
    reason: str = ""
    # making it and its first call (compilation, capture), so a report says where optimize's time went
    build_seconds: float | None = None


@dataclass
class Report:
    recipe: dict
    applied: list[str] = field(default_factory=list)  # passes that ran in the served model, with notes
    fallbacks: list[Fallback] = field(default_factory=list)
    candidates: list[Measurement] = field(default_factory=list)
    optimize_seconds: float | None = None
    first_call_seconds: float | None = None  # includes compilation of every candidate
    selection_seconds: float | None = None  # of which timing the candidates
    error: dict | None = None  # the worst output's error vs the original, from the guard
    tolerance: float | None = None  # that output's tolerance
    guard: dict | None = None  # per-output errors and tolerances on the verified input
    verified_shapes: int = 0  # input signatures checked against the original so far
    speedup: dict = field(default_factory=dict)  # served vs eager-as-given / vs best stock recipe
    active: str = "pending first call"  # which candidate serves calls
    dtype_served: str | None = None
    quantization: dict | None = None  # tk.quantize's accuracy report (SQNR vs fp32), for a quantized model
    # New input signatures verified after the first: the served form against the model as given there
    # ({"inputs": shapes, "served_ms", "given_ms", "serves": which answers that signature}; a second,
    # warm reading of a close one adds "after_calls")
    shapes: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def __str__(self) -> str:
        r = self.recipe
        lines = [f"torchkiln report: {r['device']} {r['level']} {r['dtype']} -> serving: {self.active}"
                 + (f" ({self.dtype_served})" if self.dtype_served and f"({self.dtype_served})" not in self.active
                    else "")]
        if self.speedup:
            lines.append("  speedup    " + ", ".join(f"{v:.2f}x {k.replace('_', ' ')}" for k, v in self.speedup.items()))
        lines.append(f"  applied    {', '.join(self.applied) or '-'}")
        for m in self.candidates:
            t = f"{m.median_ms:9.3f} ms" if m.median_ms is not None else f"{'-':>12}"
            built = f" (built in {m.build_seconds:.1f} s)" if m.build_seconds is not None else ""
            lines.append(f"  candidate  {m.name:<44}{t}  {m.status}{built}" + (f": {m.reason}" if m.reason else ""))
        for f in self.fallbacks:
            lines.append(f"  FALLBACK   {f.step} -> {f.to}: {f.reason}")
        if self.error is not None:
            e = self.error
            agree = f", argmax agreement {e['argmax_agree']:.1%}" if e.get("argmax_agree") is not None else ""
            n = len(self.guard["outputs"]) if self.guard else 1
            lines.append(f"  error      worst of {n} outputs: rel {e['rel']:.3g} (tolerance {self.tolerance:.3g}), "
                         f"max abs {e['max_abs']:.3g}{agree}; {self.verified_shapes} input shape(s) verified")
        for sh in self.shapes:
            when = f" after {sh['after_calls']} calls" if "after_calls" in sh else ""
            lines.append(f"  shapes     {sh['inputs']}{when}: served {sh['served_ms']:.3f} ms, as given "
                         f"{sh['given_ms']:.3f} ms -> {sh['serves']}")
        t = [f"optimize {self.optimize_seconds:.2f} s" if self.optimize_seconds is not None else None,
             f"first call {self.first_call_seconds:.2f} s" if self.first_call_seconds is not None else None,
             f"of which timing {self.selection_seconds:.2f} s" if self.selection_seconds is not None else None]
        lines.append("  time       " + ", ".join(x for x in t if x))
        lines += [f"  why        {n}" for n in r.get("notes", ())]
        return "\n".join(lines)
