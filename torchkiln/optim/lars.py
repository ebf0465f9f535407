"""LARS: You et al. 2017, "Large Batch Training of Convolutional Networks" (arXiv:1708.03888).

Per parameter tensor w with gradient g, all in fp32:

    trust = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)    (1 when ||w|| or ||g|| is 0;
                                                                    min(trust, 1) if trust_clip)
    d = (g + weight_decay * w) * trust
    buf = momentum * buf + d                                       (buf starts at 0)
    step = d + momentum * buf  if nesterov  else  buf
    w = w - lr * step

Which variant: several are in the wild. This is the paper's local LR, lambda = eta ||w|| /
(||g|| + wd ||w||), per parameter tensor rather than per layer, applied to the gradient before
momentum, with the global lr outside the momentum buffer as in torch.optim.SGD (and timm's `Lars`).
The paper's Algorithm 1 puts lr inside the buffer (v = m v + lr * lambda * (g + wd w); w = w - v):
the two are the same while lr is constant; here a schedule's new lr takes effect at once instead of
being blended in through the buffer. Not taken either: scaling the momentum buffer rather than
the gradient, and the clip of NVIDIA Apex's LARC (and timm's `trust_clip`), min(trust / lr, 1),
which reads trust as an absolute learning rate (effective rate min(trust, lr)). Here trust is a
multiplier of lr, as in the paper, so `trust_clip` is min(trust, 1): effective rate
lr * min(trust, 1), never above lr.

eps (1e-9) is not needed to avoid 0/0, the zero-norm cases are handled above. It sets the scale
below which a gradient counts as noise: with weight_decay 0, ||d|| = eta ||w|| ||g|| / (||g|| + eps),
so a gradient much smaller than eps is not blown up to a full-size step.

Excluded parameters (`exclude_from_adaptation`, or a group with `adapt=False`) take a plain SGD
step with momentum: d = g, no weight decay, no trust ratio (see lamb.py for why both go together).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import kernels
from .lamb import _check, _LayerwiseOptimizer


class Lars(_LayerwiseOptimizer):
    """LARS (see the module docstring for the exact update).

    Args:
        params: parameters or param groups. A group may override any argument below, and may set
            `adapt=False` to exclude all its parameters from adaptation.
        lr: learning rate, >= 0 (required: LARS learning rates depend on the batch size).
        momentum: in [0, 1).
        weight_decay: L2 penalty folded into the gradient and into the trust ratio, >= 0.
        eta: trust coefficient, > 0.
        eps: >= 0, see the module docstring.
        nesterov: Nesterov momentum (needs momentum > 0).
        trust_clip: cap the trust ratio at 1 (LARC-style), so no parameter's lr exceeds lr.
        exclude_from_adaptation: None, "bias_and_norm" (parameters with ndim <= 1) or a callable
            param -> bool. Excluded parameters get plain SGD with momentum.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        eps: float = 1e-9,
        nesterov: bool = False,
        trust_clip: bool = False,
        exclude_from_adaptation: Callable[[torch.Tensor], bool] | str | None = None,
    ):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps,
                        nesterov=nesterov, trust_clip=trust_clip, adapt=True)
        super().__init__(params, defaults, exclude_from_adaptation)

    def _validate(self, group: dict[str, Any]) -> None:
        lr, momentum, wd, eta, eps = (group[k] for k in ("lr", "momentum", "weight_decay", "eta", "eps"))
        _check("lr", lr, lr >= 0, ">= 0")
        _check("momentum", momentum, 0 <= momentum < 1, "in [0, 1)")
        _check("weight_decay", wd, wd >= 0, ">= 0")
        _check("eta", eta, eta > 0, "> 0")
        _check("eps", eps, eps >= 0, ">= 0")
        _check("nesterov", group["nesterov"], not group["nesterov"] or momentum > 0,
               "False when momentum is 0 (Nesterov needs momentum > 0)")
        _check("trust_clip", group["trust_clip"], isinstance(group["trust_clip"], bool), "a bool")

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype)
        return state["momentum_buffer"]

    def _compiled_step(self, group, params, dtype, adapted: bool) -> int:
        """The fused per-tensor form (kernels.py). Returns how many leading params it updated;
        the rest take the _foreach form."""
        tensors = [[p, p.grad, self._buffer(p, dtype)] for p in params]
        if not kernels.usable([t for ts in tensors for t in ts]):
            return 0
        wd = group["weight_decay"] if adapted else 0.0
        hyper = [group["lr"], group["momentum"], wd, group["eta"], group["eps"], float(group["trust_clip"]),
                 float(adapted), float(group["nesterov"])]
        for i, ts in enumerate(tensors):
            if not kernels.step("lars", ts, hyper):
                return i
        return len(params)

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], dtype: torch.dtype,
                adapted: bool) -> None:
        momentum, wd = group["momentum"], group["weight_decay"]
        done = self._compiled_step(group, params, dtype, adapted) if momentum else 0
        params = params[done:]
        if not params:
            return
        ws = [p.to(dtype) for p in params]
        # For fp32 these alias p.grad: only read, never written (clip_grad_norm_ users may log them).
        d = [p.grad.to(dtype) for p in params]

        if adapted:
            w_norm = torch.stack(torch._foreach_norm(ws))
            g_norm = torch.stack(torch._foreach_norm(d))
            trust = group["eta"] * w_norm / (g_norm + wd * w_norm + group["eps"])
            # Stays on the device: no .item(), so no host sync per step.
            trust = torch.where((w_norm > 0) & (g_norm > 0), trust, 1.0)
            if group["trust_clip"]:
                trust = trust.clamp(max=1.0)
            d = torch._foreach_add(d, ws, alpha=wd)
            torch._foreach_mul_(d, trust.unbind())

        if momentum:
            bufs = [self._buffer(p, dtype) for p in params]
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, d)
            d = torch._foreach_add(d, bufs, alpha=momentum) if group["nesterov"] else bufs
        torch._foreach_add_(ws, d, alpha=-group["lr"])
        self._write_back(params, ws)
