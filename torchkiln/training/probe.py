"""One forward+backward of a training candidate, with no trace left behind.

The training guard compares the outputs and every gradient after one step against
eager; timing runs whole steps. Both must leave the user's model as it was:
gradients, buffers (BatchNorm running statistics) and the RNG state are saved
and restored. The loss is a fixed random projection of the outputs (the user's
loss function is not known here), so every output element gets a gradient.
Dropout is switched off for the comparison only: compiled dropout draws other
random numbers than eager, so with it on no two runs could agree. Models decide
dropout on their own ``self.training`` too (transformers' attention passes
``dropout_p`` to SDPA that way), so for the comparison every module goes to eval
mode except batch-statistics norms, whose training mode is numerics, not noise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..inputs import flatten

_BATCH_STATS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def untouched(model: nn.Module, device: torch.device, dropout: bool = True):
    """Run steps inside; gradients, buffers and RNG come back as they were."""
    params = trainable(model)
    grads = [p.grad for p in params]
    bufs = [(b, b.detach().clone()) for b in model.buffers()]
    quiet = [] if dropout else [m for m in model.modules() if m.training and not isinstance(m, _BATCH_STATS)]
    devices = [device] if device.type == "cuda" else []
    try:
        for m in quiet:
            m.training = False
        with torch.random.fork_rng(devices=devices):
            yield params
    finally:
        for m in quiet:
            m.training = True
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, v in bufs:
                b.copy_(v)


def proxy_loss(out, seed: int = 0, cache: dict | None = None) -> torch.Tensor | None:
    """A fixed random projection of every float output. The projection is drawn on the output's own
    device and kept in ``cache`` for the next step: drawn on the CPU per step, GPT-2-medium's bs16
    logits (411M values) took ~2.4 s of a 55 ms H200 step and drowned the candidates' timing."""
    leaves = [t for t in flatten(out) if t.is_floating_point() and t.requires_grad]
    if not leaves:
        return None
    total = None
    for i, t in enumerate(leaves):
        key = (i, tuple(t.shape), t.device)
        w = cache.get(key) if cache is not None else None
        if w is None:
            g = torch.Generator(device=t.device).manual_seed(seed + i)
            w = torch.randn(t.shape, generator=g, device=t.device)
            if cache is not None:
                cache[key] = w
        term = (t.float() * w).sum()
        total = term if total is None else total + term
    return total


def own_loss(out) -> torch.Tensor | None:
    """The loss a model computed itself (transformers given labels: ``out.loss``), which the user's loop
    backpropagates; None where there is none."""
    loss = getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad else None


def step(fn: Callable, params: list[nn.Parameter], args, kwargs, keep: bool = True,
         cache: dict | None = None) -> list[torch.Tensor]:
    """[*float outputs, *gradients] after one forward+backward of ``fn`` from zero gradients
    (``keep=False``: for timing, nothing is copied out; ``cache`` keeps the projection between
    steps). The outputs include the model's
    own loss where it computes one (transformers with labels); the projection used to
    backpropagate is not compared: a sum of many signed terms, its relative error is
    inflated by cancellation (3% for GPT-2-medium in bf16 on the H200, where each
    output and gradient was well within tolerance)."""
    for p in params:
        p.grad = None
    out = fn(*args, **kwargs)
    # Timing (keep=False) backpropagates the model's own loss where it has one, as the loop will: the
    # projection of GPT-2-medium's logits (a float32 pass over 0.4G values and its backward) made the
    # timed compiled step 59.31 ms against 51.73 (H200, forty-fourth session). Comparing needs every
    # output's gradient, so the projection stays for that.
    loss = None if keep else own_loss(out)
    if loss is None:
        loss = proxy_loss(out, cache=cache)
    if loss is None:
        raise ValueError("the model's outputs do not depend on any trainable parameter; nothing to train")
    loss.backward()
    if not keep:
        return []
    outs = [t.detach().clone() for t in flatten(out) if t.is_floating_point()]
    return outs + [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
