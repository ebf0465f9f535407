"""The compiled training step under CUDA graphs, safe in a user's loop.

inductor's graph trees (``torch.compile(mode="reduce-overhead")``, here the
``triton.cudagraphs`` option) replay the forward and the backward as CUDA graphs
whose outputs live in one private pool, rewritten by the next replay. Two things a
training loop does then go wrong, so this wrapper, not torch, handles them:

- Gradients. autograd's AccumulateGrad takes the backward graph's gradient tensor
  itself as ``param.grad`` when there was none (``zero_grad()``'s default), so
  ``param.grad`` is pool memory. Accumulating over micro-batches (a second
  backward before ``zero_grad``) or ``zero_grad(set_to_none=False)`` then has the
  next replay write into that ``.grad`` before autograd adds to it: torch 2.x
  either raises "accessing tensor output of CUDAGraphs that has been overwritten"
  or, in the form reported in pytorch/pytorch#96693, sums the wrong values
  silently. Before each call, a ``.grad`` this wrapper has not seen is copied out
  of the pool once; autograd then accumulates into the copy. A loop that sets
  gradients to None each step (the common one) copies nothing.
- Outputs. A loss or logits kept past the next step (``losses.append(loss.detach())``)
  would be rewritten under the user; every output is copied out of the pool, as the
  inference path does for its CUDA graphs (GPT-2-medium's bf16 logits at bs16
  seq512: 0.8 GB a step, measured in the train_step benchmark's torchkiln row).

At level O2 the step is a timed candidate beside the plain compiled one, so it serves
only where the replays' saved launches outweigh those copies. GPT-2-medium bs16 seq512
on the H200 (benchmarks/RESULTS.md, forty-fourth session): stock reduce-overhead ran
1.02-1.06x stock torch.compile in a loop, but this step timed 51.95 ms against the plain
compiled step's 51.73 in tk.optimize's own timing, so it is not the O1 default. Not under a process group (collectives inside a captured
graph are NCCL's and the user's launcher's business) nor with split weights (their
rebuild gives parameters new storage, which graph trees would re-record for).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .. import inputs


class GraphedStep:
    def __init__(self, fn, params: list[nn.Parameter]):
        self.fn = fn
        self.params = params
        self._own: dict[int, weakref.ref] = {}  # id(param) -> the .grad copy this wrapper made

    def __call__(self, *args, **kwargs):
        self.own_grads()
        return inputs.clone(self.fn(*args, **kwargs))

    def own_grads(self) -> int:
        """Copy out of the pool each ``.grad`` the next replay could overwrite; returns how many."""
        copied = 0
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            mine = self._own.get(id(p))
            if mine is not None and mine() is g:
                continue
            with torch.no_grad():
                p.grad = g.clone()
            self._own[id(p)] = weakref.ref(p.grad)
            copied += 1
        return copied
