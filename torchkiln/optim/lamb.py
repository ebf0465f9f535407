"""LAMB: You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"
(arXiv:1904.00962), Algorithm 2, with the scaling function phi(z) = z, or min(z, trust_clip).

Per parameter tensor w with gradient g (negated if `maximize`), at its step t, all in fp32:

    m = b1 m + (1 - b1) g                  v = b2 v + (1 - b2) g^2
    mhat = m / (1 - b1^t)                  vhat = v / (1 - b2^t)        (mhat = m, vhat = v without
                                                                          bias_correction)
    r = mhat / (sqrt(vhat) + eps)
    u = r + weight_decay * w
    trust = ||w|| / ||u||                  (1 when either norm is 0; then min(trust, trust_clip))
    w = w - lr * trust * u

A "layer" is one parameter tensor: a Linear's weight and bias each get their own ratio.

Excluded parameters (`exclude_from_adaptation`, or a param group with `adapt=False`) take
weight_decay = 0 and trust = 1, i.e. a plain Adam step. One switch covers both because the reasons
are the same: a bias is often 0 or small, so ||w|| / ||u|| would all but freeze it, and
decaying a LayerNorm gain towards 0 fights the normalisation. This is also TensorFlow Addons' LAMB
default (layer adaptation falls back to the weight-decay exclusion list). Exclusion wins over a
group's `weight_decay`: an `adapt=False` group is never decayed, whatever its weight_decay says.

This file also holds `_LayerwiseOptimizer`, the part LAMB and LARS share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer

from . import kernels

BIAS_AND_NORM = "bias_and_norm"


def _check(name: str, value: Any, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {valid}")


def _never(p: torch.Tensor) -> bool:
    return False


def _bias_and_norm(p: torch.Tensor) -> bool:
    return p.ndim <= 1


def _exclusion(arg: Any) -> Callable[[torch.Tensor], bool]:
    # Module-level functions rather than lambdas, so the optimizer still pickles.
    if arg is None:
        return _never
    if isinstance(arg, str) and arg == BIAS_AND_NORM:
        return _bias_and_norm
    if callable(arg) and not isinstance(arg, str):
        return arg
    raise ValueError(f"exclude_from_adaptation={arg!r} is invalid: must be None, "
                     f"{BIAS_AND_NORM!r} or a callable param -> bool")


class _LayerwiseOptimizer(Optimizer):
    """The parts LAMB and LARS share: validation of every param group, bucketing of a group's
    parameters by device, compute dtype and adaptation, fp32 state, and the closure protocol.
    Subclasses define `_validate(group)` and `_update(group, params, dtype, adapted)`."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], exclude_from_adaptation: Any):
        # The callable is kept off the param groups: those go into state_dict, which must pickle.
        self._excluded = _exclusion(exclude_from_adaptation)
        self._validate(defaults)
        super().__init__(params, defaults)

    def _validate(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], dtype: torch.dtype,
                adapted: bool) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Per-group overrides (lr, weight_decay, ...) are checked like the constructor's arguments.
        if isinstance(param_group, dict):
            self._validate({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Bucket every group first, so a sparse gradient anywhere raises before any parameter moves.
        work = [(group, key, params) for group in self.param_groups
                for key, params in self._buckets(group).items()]
        for group, (_, dtype, adapted), params in work:
            self._update(group, params, dtype, adapted)
        return loss

    def _buckets(self, group: dict[str, Any]) -> dict[tuple[Any, ...], list[torch.Tensor]]:
        # A foreach call wants one device; bf16/fp16 compute in fp32 (fp64 stays fp64).
        buckets: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # (device, compute dtype, adapted)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.layout != torch.strided:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients (got a "
                                   f"{p.grad.layout} gradient for a parameter of shape {tuple(p.shape)})")
            if p.is_complex():
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
            adapted = bool(group["adapt"]) and not self._excluded(p)
            key = (p.device, _compute_dtype(p), adapted)
            buckets.setdefault(key, []).append(p)
        return buckets

    @staticmethod
    def _write_back(params: list[torch.Tensor], ws: list[torch.Tensor]) -> None:
        # fp32 params were updated in place (p.to(fp32) is p); low-precision ones round once here.
        low = [(p, w) for p, w in zip(params, ws, strict=True) if p is not w]
        if low:
            torch._foreach_copy_([p for p, _ in low], [w for _, w in low])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Optimizer.load_state_dict casts every state tensor to its parameter's dtype, which would
        # round bf16 models' moments to bf16. Re-read them from the saved copy instead.
        saved = state_dict["state"]
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params, strict=True):
            for key, value in saved.get(pid, {}).items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=_compute_dtype(p))


def _compute_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.promote_types(p.dtype, torch.float32)


class Lamb(_LayerwiseOptimizer):
    """LAMB (see the module docstring for the exact update).

    Args:
        params: parameters or param groups. A group may override any argument below, and may set
            `adapt=False` to exclude all its parameters from adaptation.
        lr: learning rate, >= 0.
        betas: (b1, b2), each in [0, 1).
        eps: added to sqrt(vhat), > 0 (0 would give 0/0 for a gradient entry that has always been 0).
        weight_decay: decoupled-from-the-gradient decay inside the trust ratio, >= 0.
        trust_clip: upper bound on the trust ratio, > 0; None for no bound.
        bias_correction: divide the moments by 1 - b^t, as Adam does.
        exclude_from_adaptation: None, "bias_and_norm" (parameters with ndim <= 1) or a callable
            param -> bool. Excluded parameters get no weight decay and trust 1 (an Adam step).
        maximize: ascend the objective instead of descending it.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        trust_clip: float | None = None,
        bias_correction: bool = True,
        exclude_from_adaptation: Callable[[torch.Tensor], bool] | str | None = None,
        maximize: bool = False,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, trust_clip=trust_clip,
                        bias_correction=bias_correction, maximize=maximize, adapt=True)
        super().__init__(params, defaults, exclude_from_adaptation)

    def _validate(self, group: dict[str, Any]) -> None:
        lr, betas, eps, wd, clip = (group[k] for k in ("lr", "betas", "eps", "weight_decay", "trust_clip"))
        _check("lr", lr, lr >= 0, ">= 0")
        _check("betas", betas, isinstance(betas, (tuple, list)) and len(betas) == 2, "a pair (b1, b2)")
        _check("betas[0]", betas[0], 0 <= betas[0] < 1, "in [0, 1)")
        _check("betas[1]", betas[1], 0 <= betas[1] < 1, "in [0, 1)")
        _check("eps", eps, eps > 0, "> 0")
        _check("weight_decay", wd, wd >= 0, ">= 0")
        # A bool is an int to Python; trust_clip=True would silently mean "clip at 1".
        _check("trust_clip", clip, clip is None or (not isinstance(clip, bool) and clip > 0), "None or > 0")

    def _init_state(self, p: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            # A CPU scalar as in torch.optim.Adam: the bias corrections are then host floats, no sync.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        return state

    def _compiled_step(self, group, params, states, adapted: bool) -> int:
        """The fused per-tensor form (kernels.py). Returns how many leading params it updated;
        the rest take the _foreach form."""
        tensors = [[p, p.grad, s["exp_avg"], s["exp_avg_sq"]] for p, s in zip(params, states, strict=True)]
        if not kernels.usable([t for ts in tensors for t in ts]):
            return 0
        b1, b2 = group["betas"]
        clip = group["trust_clip"] if group["trust_clip"] is not None else float("inf")
        wd = group["weight_decay"] if adapted else 0.0
        sign = -1.0 if group["maximize"] else 1.0
        for i, (ts, s) in enumerate(zip(tensors, states, strict=True)):
            t = float(s["step"]) + 1
            bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
            if not kernels.step("lamb", ts, [group["lr"], b1, b2, bc1, bc2, group["eps"], wd, clip,
                                             float(adapted), sign]):
                return i  # this tensor is unchanged (its step counter too)
            s["step"] += 1
        return len(params)

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], dtype: torch.dtype,
                adapted: bool) -> None:
        b1, b2 = group["betas"]
        states = [self._init_state(p, dtype) for p in params]
        done = self._compiled_step(group, params, states, adapted)
        params, states = params[done:], states[done:]
        if not params:
            return
        ws = [p.to(dtype) for p in params]
        gs = [p.grad.to(dtype) for p in params]
        if group["maximize"]:
            gs = torch._foreach_neg(gs)
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        for s in states:
            s["step"] += 1

        torch._foreach_lerp_(exp_avg, gs, 1 - b1)
        torch._foreach_mul_(exp_avg_sq, b2)
        torch._foreach_addcmul_(exp_avg_sq, gs, gs, value=1 - b2)
        mhat, vhat = exp_avg, exp_avg_sq
        if group["bias_correction"]:
            # Per tensor, not per group: a parameter that skipped steps (no grad) has its own t.
            t = [float(s["step"]) for s in states]
            mhat = torch._foreach_div(exp_avg, [1 - b1**i for i in t])
            vhat = torch._foreach_div(exp_avg_sq, [1 - b2**i for i in t])
        denom = torch._foreach_sqrt(vhat)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(mhat, denom)

        if adapted:
            if group["weight_decay"]:
                torch._foreach_add_(update, ws, alpha=group["weight_decay"])
            w_norm = torch.stack(torch._foreach_norm(ws))
            u_norm = torch.stack(torch._foreach_norm(update))
            # Stays on the device: no .item(), so no host sync per step.
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
            if group["trust_clip"] is not None:
                trust = trust.clamp(max=group["trust_clip"])
            torch._foreach_mul_(update, (trust * group["lr"]).unbind())
        else:
            torch._foreach_mul_(update, group["lr"])
        torch._foreach_sub_(ws, update)
        self._write_back(params, ws)
