"""tk.check(): consistency checks a user can run on any model before deploying.

- eager vs optimized (tk.optimize with the given dtype/level), on an input other
  than the one optimize verified with (same shapes, values drawn afresh), under
  the guard's rules (guard.py);
- grad-enabled vs no_grad vs inference_mode: one IPEX release changed ResNet
  outputs under no_grad on XPU (MAE 1.48); identical modes must agree closely;
- device vs CPU, when the model lives on an accelerator;
- fp32 vs bf16 (or the dtype asked).

When a check fails, the first submodule (in call order) whose output diverges
is named, found by forward hooks on both runs.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import _log, inputs
from ._log import quiet_deprecations
from .guard import CAP, compare, compare_each, tolerances
from .modelutil import DTYPES, keeps_mode, model_device, parse_dtype
from .optimize import optimize

MODE_TOLERANCE = 1e-5  # same kernels, same dtype: anything above this is a bug, not rounding


@dataclass
class CheckRow:
    name: str
    error: dict
    tolerance: float
    ok: bool
    first_divergence: str | None = None
    note: str = ""
    per_output: list = field(default_factory=list)  # rel error of each output tensor


@dataclass
class CheckResult:
    rows: list[CheckRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [asdict(r) for r in self.rows]}

    def __str__(self) -> str:
        lines = [f"{'check':<34}{'rel err':>10}{'max abs':>10}{'tolerance':>11}  result"]
        for r in self.rows:
            e = r.error
            lines.append(f"{r.name:<34}{e['rel']:>10.2g}{e['max_abs']:>10.2g}{r.tolerance:>11.0e}  "
                         f"{'ok' if r.ok else 'DIVERGES'}" + (f"  {r.note}" if r.note else ""))
            if len(r.per_output) > 1:
                lines.append("    per output: " + ", ".join(f"[{i}] {e:.2g}" for i, e in enumerate(r.per_output)))
            if r.first_divergence:
                lines.append(f"    first diverging submodule: {r.first_divergence}")
        lines.append("all consistent" if self.ok else "INCONSISTENT: see rows marked DIVERGES")
        return "\n".join(lines)


def _run(model, sample, mode: str = "no_grad"):
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with ctx():
        out = model(*sample[0], **sample[1])
    return inputs.tree_map(lambda t: t.detach().float() if t.is_floating_point() else t.detach(), out)


def record_outputs(model: nn.Module, sample, mode: str = "no_grad") -> dict[str, torch.Tensor]:
    """Each submodule's first tensor output, keyed by name, in call order."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def hook(m, args, out, name=name):
            ts = inputs.flatten(out)
            if ts and name not in seen:
                seen[name] = ts[0].detach().float().cpu().clone()
        hooks.append(mod.register_forward_hook(hook))
    try:
        _run(model, sample, mode)
    finally:
        for h in hooks:
            h.remove()
    return seen


def first_divergence(a: nn.Module, sample_a, b: nn.Module, sample_b, tol: float,
                     mode_a: str = "no_grad", mode_b: str = "no_grad") -> str | None:
    outs_a = record_outputs(a, sample_a, mode_a)
    outs_b = record_outputs(b, sample_b, mode_b)
    for name, ta in outs_a.items():  # call order of the first run
        tb = outs_b.get(name)
        if tb is None or tb.shape != ta.shape:
            continue
        err = compare(ta, tb)
        if not err.ok(tol):
            return f"{name} ({type(a.get_submodule(name)).__name__}): {err}"
    return None


def fresh_like(sample: inputs.Args, seed: int = 1234) -> inputs.Args:
    """Another input of the same shapes: floats drawn again with the sample's mean and
    spread; integer tensors (token ids) permuted, so every value stays valid; masks kept."""
    g = torch.Generator().manual_seed(seed)

    def new(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            r = torch.randn(t.shape, generator=g).to(t.dtype).to(t.device)
            return r * t.float().std().nan_to_num(1.0).to(t.dtype) + t.float().mean().to(t.dtype)
        if t.numel() > 1 and not t.dtype == torch.bool:
            return t.flatten()[torch.randperm(t.numel(), generator=g).to(t.device)].view_as(t)
        return t

    args, kwargs = sample
    kw = {k: (v if "mask" in k or not isinstance(v, torch.Tensor) else new(v)) for k, v in kwargs.items()}
    return inputs.tree_map(new, args), kw


@keeps_mode
@quiet_deprecations()  # torch's notices from what it runs are not the caller's (_log.py)
def check(model: nn.Module, sample_input, dtype=torch.bfloat16, level: str = "O1",
          optimized: nn.Module | None = None, checks: tuple[str, ...] | None = None) -> CheckResult:
    """Run the consistency checks; returns a CheckResult (``print`` it, or ``.to_dict()``)."""
    _log.configure()
    if not isinstance(model, nn.Module):
        raise TypeError(f"check() expects a torch.nn.Module, got {type(model).__name__}")
    low = parse_dtype(dtype)
    dev = model_device(model)
    sample = inputs.to(inputs.normalize(sample_input), dev)
    wanted = checks or ("optimized", "no_grad", "inference_mode", "device_vs_cpu", "dtype")
    result = CheckResult()
    base = _run(model, sample, "grad")

    def add(name, out, ref, tol, locate=None, note=""):
        err = compare(out, ref)
        ok = err.ok(tol)
        where = locate() if (not ok and locate) else None
        each = [e.rel for e in compare_each(out, ref)]
        result.rows.append(CheckRow(name, err.to_dict(), tol, ok, where, note, each))

    if "no_grad" in wanted:
        add("grad vs no_grad", _run(model, sample, "no_grad"), base, MODE_TOLERANCE,
            lambda: first_divergence(model, sample, model, sample, MODE_TOLERANCE, "grad", "no_grad"))
    if "inference_mode" in wanted:
        add("grad vs inference_mode", _run(model, sample, "inference_mode"), base, MODE_TOLERANCE,
            lambda: first_divergence(model, sample, model, sample, MODE_TOLERANCE, "grad", "inference_mode"))
    if "device_vs_cpu" in wanted and dev.type != "cpu":
        cpu_model = copy.deepcopy(model).cpu()
        cpu_sample = inputs.to(sample, "cpu")
        tol = CAP[torch.float32] * 10  # two devices' kernels: fp32 rounding, not a bit-exact match
        add(f"{dev.type} vs cpu", _run(model, sample), _run(cpu_model, cpu_sample), tol,
            lambda: first_divergence(model, sample, cpu_model, cpu_sample, tol))
    if "dtype" in wanted and low != torch.float32:
        low_model = copy.deepcopy(model).to(low)
        low_sample = inputs.to(sample, dtype=low)
        tol = CAP[low]
        add(f"fp32 vs {str(low)[6:]} (full cast)", _run(low_model, low_sample), base, tol,
            lambda: first_divergence(model, sample, low_model, low_sample, tol))
    if "optimized" in wanted:
        opt = optimized if optimized is not None else optimize(model, dtype=low, level=level, sample_input=sample_input)
        served = getattr(getattr(opt, "kiln_report", None), "dtype_served", None)
        served = DTYPES.get(served or "", low)
        fresh = fresh_like(sample)
        ref = _run(model, fresh)
        baseline = None
        if served != torch.float32:
            cast = copy.deepcopy(model).to(served)
            baseline = compare_each(_run(cast, inputs.to(fresh, dtype=served)), ref)
            del cast
        tols = tolerances(served, baseline, len(compare_each(ref, ref)))
        note = f"serving: {opt.kiln_report.active}" if hasattr(opt, "kiln_report") else ""
        each = compare_each(_run(opt, fresh), ref)
        worst = max(range(len(each)), key=lambda i: each[i].rel / tols[min(i, len(tols) - 1)])
        tol = tols[min(worst, len(tols) - 1)]
        ok = all(e.ok(tols[min(i, len(tols) - 1)]) for i, e in enumerate(each))
        result.rows.append(CheckRow(f"eager vs optimized ({str(served)[6:]}, new input)", each[worst].to_dict(), tol,
                                    ok, None, note, [e.rel for e in each]))
    return result
