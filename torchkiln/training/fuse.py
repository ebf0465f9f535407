"""Make the user's torch optimizer take fused steps, in place.

The object stays the same, so an LR scheduler or GradScaler made before or after
tk.optimize keeps working: only its param groups' ``fused``/``foreach`` flags
change, as if it had been built with ``fused=True``. torch decides which classes
and devices have fused kernels; whether one does is asked of torch itself (by
building a throwaway optimizer with ``fused=True``), so this stays right as torch
adds kernels. Classes without a fused kernel keep their own step; torchkiln's own
optimizers (tk.optim) are fast as they are.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from ..modelutil import dtype_name

_REFUSED: weakref.WeakSet = weakref.WeakSet()  # optimizers fused again after each load_state_dict


@functools.lru_cache(maxsize=64)
def fused_supported(cls: type, device_type: str, dtype: torch.dtype) -> bool:
    """Does torch have a fused step for this optimizer class on this device and dtype, one that computes
    what its own step computes? Asked of torch: two steps of each on a 67-value parameter (vector blocks
    and a remainder), with momentum where the class has it. Why the numbers: torch's CPU fused SGD left
    every full vector block of a bf16/fp16 parameter unchanged (pytorch/pytorch#191763; torch 2.6 and
    2.13 here), and tk.optimize had switched SGD on a bf16 model to it: the weights never moved, with no
    error (a new-user probe's bf16 model, fiftieth session)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    if "fused" not in params:
        return False
    kw = {"lr": 0.1, **({"momentum": 0.9} if "momentum" in params else {})}
    start = torch.linspace(-1, 1, 67, device=device_type).to(dtype)
    grad = torch.linspace(0.5, -0.3, 67, device=device_type).to(dtype)  # no zero: fp16 Adam divides by it
    got = []
    for fused in (True, False):
        p = start.clone().requires_grad_()
        try:
            opt = cls([p], fused=fused, **({} if fused else {"foreach": False}), **kw)
            for _ in range(2):
                p.grad = grad.clone()
                opt.step()
        except Exception:
            return False
        got.append(p.detach().float())
    moved = float((got[1] - start.float()).norm())
    return moved > 0 and float((got[0] - got[1]).norm()) <= 0.05 * moved


def _params(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def choose(optimizer: torch.optim.Optimizer, level: str) -> tuple[str, str]:
    """What to do with ``optimizer`` (nothing changes yet): (kind, why); kind "fused" means
    ``fuse()`` will switch it to torch's fused step."""
    name = type(optimizer).__name__
    if type(optimizer).__module__.startswith("torchkiln.optim"):
        return "torchkiln", f"{name} is torchkiln's own (multi-tensor) step"
    if level == "O0":
        return "unchanged", f"{name} unchanged (O0)"
    params = _params(optimizer)
    kinds = {(p.device.type, p.dtype) for p in params}
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return "own step", f"{name}(differentiable=True) has no fused step; kept as is"
    if any(p.is_sparse or not p.is_floating_point() for p in params) or not all(
            fused_supported(type(optimizer), d, t) for d, t in kinds):
        where = ", ".join(sorted(f"{d}/{dtype_name(t)}" for d, t in kinds))
        return "own step", (f"torch has no fused {name} step for {where} that matches its own step (both run on a "
                            "small parameter; torch's CPU fused SGD skips bf16/fp16 updates: pytorch/pytorch#191763); "
                            "its own step is kept")
    if all(g.get("fused") for g in optimizer.param_groups):
        return "fused", f"{name} was already fused"
    return "fused", f"{name} switched to torch's fused step (fused=True), same object"


def fuse(optimizer: torch.optim.Optimizer) -> None:
    """Switch ``optimizer`` (which ``choose`` said "fused" for) to torch's fused step, in place, and
    again after each ``load_state_dict``: a checkpoint saved from the stock optimizer carries
    ``fused=None`` in its param groups, which loading put back, and the fused step was gone (a
    new-user probe, thirty-seventh session). The flags choose kernels, not numbers."""
    if optimizer not in _REFUSED:
        hook = getattr(optimizer, "register_load_state_dict_post_hook", None)  # torch >= 2.3
        if hook is not None:
            hook(fuse)
            _REFUSED.add(optimizer)
    for g in optimizer.param_groups:
        g["fused"], g["foreach"] = True, False
    optimizer.defaults["fused"], optimizer.defaults["foreach"] = True, False
    # As torch's own __init__ does for fused=True: GradScaler then hands the step its
    # scale and inf flag instead of unscaling the gradients in a separate pass.
    optimizer._step_supports_amp_scaling = True
    # Fused kernels want step counters on the parameter's device (a warm optimizer has them on CPU).
    for p in _params(optimizer):
        st = optimizer.state.get(p, {})
        if isinstance(st.get("step"), torch.Tensor) and st["step"].device != p.device:
            st["step"] = st["step"].to(p.device, torch.float32)
