"""Split bf16 master weights (IPEX's ``split_master_weight_for_bf16``).

Each weight the optimizer trains (every float32 parameter with two or more dims:
Linear, Conv, Embedding, transformers' Conv1D) is stored as two 16-bit halves: its
bf16 value, which the model computes with, and a 16-bit trail, the difference to
the float32 master. Together they are the float32 value bit for bit, so nothing is
rounded away between steps and ``state_dict`` returns the exact masters.

The bf16 half rounds to nearest (ties away from zero instead of to even, so the
difference always fits 16 bits): what autocast would cast the weight to, except on
exact ties. Parameters keep their identity (the optimizer, a scheduler, hooks see the
same objects); their ``.data`` becomes a view into one flat bf16 buffer.

The optimizer's own step runs on float32 masters: ``step()`` rebuilds them one chunk
of parameters at a time, runs the optimizer's step (torch's fused one) restricted to
that chunk, and splits the result again. So updates are torch's arithmetic exactly,
and the transient float32 copy is one chunk, not the model.

Why hand-written: torch has no split-weight optimizer (its fused steps update bf16
parameters in bf16), and an fp32 master copy beside a bf16 model costs 6 bytes per
parameter where this costs 4.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn

from .._log import warn_once
from ..modelutil import first_line

CHUNK = 1 << 26  # elements per master chunk: 256 MB of float32 at a time


def eligible(p: torch.Tensor) -> bool:
    return p.dtype == torch.float32 and p.dim() >= 2 and p.requires_grad and not p.is_sparse and _dense(p)


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill storage[offset:offset+numel] exactly, in some order (contiguous, channels_last, ...)."""
    expect = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order: the split halves keep its layout (channels_last)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _shaped(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return flat.as_strided(like.shape, like.stride(), flat.storage_offset())


# The two functions below see only integer views: the float views are taken outside them, because
# torch 2.6's inductor compiled a float32 bitcast so that NaN payloads came back canonical (0x7FD88000 ->
# 0x7FC00000; tests/training/test_split.py on torch 2.6).
def _split_eager(bits: torch.Tensor, top: torch.Tensor, trail: torch.Tensor) -> None:
    """float32 master bits (int32) -> bf16 ``top`` bits (int16) and int16 ``trail``, exactly:
    top = round(master / 2^16) with ties up in magnitude (the sign bit rides along: the pattern of a
    negative float is -2^31 + magnitude), trail = master - top * 2^16, which lies in [-2^15, 2^15)."""
    hi = (bits + 0x8000) >> 16
    top.copy_(hi)
    trail.copy_(bits - (hi << 16))


def _combine_eager(top: torch.Tensor, trail: torch.Tensor) -> torch.Tensor:
    """bf16 ``top`` bits (int16) and the int16 ``trail`` -> the float32 master's bits (int32)."""
    return (top.to(torch.int32) << 16) + trail.to(torch.int32)


@functools.cache
def _kernels() -> dict:
    # Eager, each of the two is five int32 tensor ops: about 60 bytes of memory traffic per weight and
    # step, 13% of a GPT-2-medium step on the H200 (benchmarks/RESULTS.md). Compiled, each is one pass.
    return {"split": torch.compile(_split_eager, dynamic=True), "combine": torch.compile(_combine_eager, dynamic=True)}


_EAGER = {"split": _split_eager, "combine": _combine_eager}
_broken: set[str] = set()  # compiled forms that failed here: eager from then on, in this process


def _run(name: str, *args):
    if name not in _broken:
        try:
            return _kernels()[name](*args)
        except Exception as e:  # a compiler missing or failing: the eager form computes the same bits
            _broken.add(name)
            warn_once(f"split-compile:{name}", f"torchkiln: the compiled split-weight {name} failed "
                      f"({type(e).__name__}: {first_line(e)}); it runs as plain tensor ops")
    return _EAGER[name](*args)


def _split_into(master: torch.Tensor, top: torch.Tensor, trail: torch.Tensor) -> None:
    _run("split", master.view(torch.int32), top.view(torch.int16), trail)


def _combine(top: torch.Tensor, trail: torch.Tensor) -> torch.Tensor:
    return _run("combine", top.view(torch.int16), trail).view(torch.float32)


class SplitWeights:
    """The split parameters of one model and the optimizer that trains them."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer):
        self.params = params
        self.optimizer = optimizer
        n = sum(p.numel() for p in params)
        device = params[0].device
        self.top = torch.empty(n, dtype=torch.bfloat16, device=device)
        self.trail = torch.empty(n, dtype=torch.int16, device=device)
        self.spans: list[tuple[int, int]] = []
        o = 0
        with torch.no_grad():
            for p in params:
                k = p.numel()
                _split_into(_flat(p.detach()), self.top[o:o + k], self.trail[o:o + k])
                self.spans.append((o, k))
                o += k
        self._flat = None  # the float32 masters while to_masters() holds them
        self._halves()
        self.chunks = self._chunks()
        self._inner_step = optimizer.step
        self._own_step = "step" in vars(optimizer)  # a scheduler's wrapper, to restore on release
        # A bound method, as torch's own: an LR scheduler made later wraps ``step.__func__``. One made
        # before wrapped the step we call; its mark is kept, or it would warn that step was replaced.
        def step(opt, *args, **kwargs):
            return self.step(*args, **kwargs)

        if hasattr(self._inner_step, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True
        optimizer.step = types.MethodType(step, optimizer)
        self._hooks = [optimizer.register_load_state_dict_pre_hook(lambda opt, sd: self.to_masters()),
                       optimizer.register_load_state_dict_post_hook(lambda opt: self.to_halves())]

    # ------------------------------------------------------------- layout
    @property
    def active(self) -> bool:
        """The parameters hold their bf16 halves (not the float32 masters of ``to_masters``)."""
        return self._flat is None

    def _chunks(self) -> list[list[int]]:
        out: list[list[int]] = [[]]
        size = 0
        for i, (_, k) in enumerate(self.spans):
            if out[-1] and size + k > CHUNK:
                out.append([])
                size = 0
            out[-1].append(i)
            size += k
        return out

    def _halves(self, idx=None) -> None:
        for i in idx if idx is not None else range(len(self.params)):
            o, k = self.spans[i]
            self.params[i].data = _shaped(self.top[o:o + k], self.params[i])

    def master(self, i: int) -> torch.Tensor:
        """Parameter i's float32 master value (a new tensor)."""
        o, k = self.spans[i]
        return _shaped(_combine(self.top[o:o + k], self.trail[o:o + k]), self.params[i])

    def _range(self, idx: list[int]) -> tuple[int, int]:
        return self.spans[idx[0]][0], self.spans[idx[-1]][0] + self.spans[idx[-1]][1]

    def _masters(self, idx: list[int]) -> torch.Tensor:
        """Parameters ``idx`` (consecutive) become views into one new float32 buffer of their masters."""
        o0, o1 = self._range(idx)
        flat = _combine(self.top[o0:o1], self.trail[o0:o1])
        for i in idx:
            o, k = self.spans[i]
            self.params[i].data = _shaped(flat[o - o0:o - o0 + k], self.params[i])
        return flat

    def _resplit(self, idx: list[int], flat: torch.Tensor) -> None:
        """``flat`` (what ``_masters`` returned, updated in place) split back into the halves, in one pass."""
        o0, o1 = self._range(idx)
        with torch.no_grad():
            _split_into(flat, self.top[o0:o1], self.trail[o0:o1])
        self._halves(idx)

    def to_masters(self) -> None:
        """Every split parameter back to float32 (its exact master) until ``to_halves``."""
        if self.active:
            self._flat = self._masters(list(range(len(self.params))))

    def to_halves(self) -> None:
        if not self.active:
            self._resplit(list(range(len(self.params))), self._flat)
            self._flat = None

    @contextlib.contextmanager
    def masters(self):
        self.to_masters()
        try:
            yield
        finally:
            self.to_halves()

    def release(self) -> None:
        """Undo the split for good: float32 parameters, the optimizer's own step back."""
        self.to_masters()
        if self._own_step:
            self.optimizer.step = self._inner_step
        else:
            del self.optimizer.step
        for h in self._hooks:
            h.remove()

    # ------------------------------------------------------------- the step
    def step(self, closure=None, **kwargs):
        loss = None
        if closure is not None:  # evaluated once, not once per chunk
            with torch.enable_grad():
                loss = closure()
        split = {id(p) for p in self.params}
        groups = self.optimizer.param_groups
        full = [g["params"] for g in groups]
        for n, idx in enumerate(self.chunks):
            mine = {id(self.params[i]) for i in idx}
            keep = [[p for p in ps if id(p) in mine or (n == 0 and id(p) not in split)] for ps in full]
            grads = [self.params[i].grad for i in idx]
            flat = self._masters(idx)
            for i, g in zip(idx, grads, strict=True):
                if g is not None:  # torch's steps want gradients in the parameter's dtype
                    self.params[i].grad = g.float()
            try:
                for g, ps in zip(groups, keep, strict=True):
                    g["params"] = ps
                self.optimizer.param_groups = [g for g in groups if g["params"]]
                self._inner_step(**kwargs)
            finally:  # the groups, the halves and the bf16 gradients as they were, even if the step raised
                self.optimizer.param_groups = groups
                for g, ps in zip(groups, full, strict=True):
                    g["params"] = ps
                self._resplit(idx, flat)
                for i, g in zip(idx, grads, strict=True):
                    self.params[i].grad = g
        return loss


# Optimizers whose update of a parameter reads only that parameter's own gradient and state: a step
# taken one chunk at a time is their step. (LBFGS, or one that clips by a global norm, is not.)
PER_PARAMETER = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop",
                 "Lamb", "Lars")


def why_not(optimizer: torch.optim.Optimizer) -> str | None:
    cls = type(optimizer)
    mod = cls.__module__
    if cls.__name__ in PER_PARAMETER and (mod.startswith("torch.optim") or mod.startswith("torchkiln.optim")):
        return None
    return (f"{cls.__name__} is not one of the optimizers known to update each parameter from its own state "
            f"({', '.join(PER_PARAMETER)}); split master weights step in chunks")


def split_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters ``SplitWeights`` would split: trained by ``optimizer``, eligible, one device."""
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) in trained and id(p) not in seen and eligible(p):
            seen.add(id(p))
            out.append(p)
    return out if len({p.device for p in out}) == 1 else []
