"""Compiled per-tensor steps for Lamb and Lars: each one fused pass (plus the norms).

Why compiled: the multi-tensor (_foreach) form makes a new full-size tensor per
intermediate (m-hat, v-hat, the denominator, the update). On CPU those are fresh
large allocations every step, and a 109M-parameter Lamb step took 2220 ms against
493 ms for a plain per-parameter loop (benchmarks/train_optim.py, 2 cores, RESULTS.md).
Inductor fuses a tensor's whole update into a reduction pass (the norms) and one
update pass, in place. Tensors are flattened and compiled with dynamic shapes,
so one graph serves every parameter; hyper-parameters travel as one small
tensor, so a scheduler's new lr or the bias correction never recompiles.
Where compilation is unavailable (no C++ compiler, an unsupported device), the
optimizers keep their _foreach form: ``step`` returns False and they carry on.
"""

from __future__ import annotations

import torch

from .._log import warn_once

_state = {"broken": None}  # the first compile failure, after which the _foreach form is used


def _lamb(p, g, m, v, h):
    lr, b1, b2, bc1, bc2, eps, wd, clip, adapt, sign = h.unbind()
    w, gr = p.float(), g.float() * sign
    m.lerp_(gr, 1 - b1)
    v.mul_(b2).add_((1 - b2) * gr * gr)
    u = (m / bc1) / ((v / bc2).sqrt() + eps) + wd * w
    wn, un = w.norm(), u.norm()
    trust = torch.where((wn > 0) & (un > 0), wn / un, 1.0).clamp(max=clip)
    trust = torch.where(adapt > 0, trust, 1.0)
    p.copy_(w - lr * trust * u)


def _lars(p, g, buf, h):
    lr, momentum, wd, eta, eps, clip, adapt, nesterov = h.unbind()
    w, gr = p.float(), g.float()
    wn, gn = w.norm(), gr.norm()
    trust = torch.where((wn > 0) & (gn > 0), eta * wn / (gn + wd * wn + eps), 1.0)
    trust = torch.where(clip > 0, trust.clamp(max=1.0), trust)
    trust = torch.where(adapt > 0, trust, 1.0)
    d = (gr + wd * w) * trust
    buf.mul_(momentum).add_(d)
    p.copy_(w - lr * torch.where(nesterov > 0, d + momentum * buf, buf))


_compiled: dict = {}


def _fn(name):
    if name not in _compiled:
        _compiled[name] = torch.compile({"lamb": _lamb, "lars": _lars}[name], dynamic=True, fullgraph=True)
    return _compiled[name]


def usable(tensors) -> bool:
    return _state["broken"] is None and all(
        t.is_contiguous() and t.device.type in ("cpu", "cuda") and t.dtype in (torch.float32, torch.bfloat16,
                                                                              torch.float16) for t in tensors)


def step(name: str, tensors: list[torch.Tensor], hyper: list[float]) -> bool:
    """Run one compiled per-tensor step (tensors: p, g, then the state). False: not done,
    use the _foreach form (compilation failed once in this process)."""
    h = torch.tensor(hyper, dtype=torch.float32, device=tensors[0].device)
    try:
        _fn(name)(*[t.view(-1) for t in tensors], h)
    except Exception as e:
        _state["broken"] = e
        warn_once(f"optim-compile:{type(e).__name__}", f"torchkiln: compiled {name} step unavailable "
                  f"({type(e).__name__}: {str(e)[:200]}); using the multi-tensor form")
        return False
    return True
