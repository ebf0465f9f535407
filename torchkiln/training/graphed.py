"""The compiled training step replayed from CUDA graphs: one graph for the forward, one for the backward.

Why: on the H200 the stock compiled step (torch.compile + autocast bf16 + fused AdamW) of GPT-2-medium
bs16 seq512 ran 50.2 ms of kernels in a 55.8-ms step, the GPU idle between kernels the rest. Replayed
from graphs the same step ran 1.070x the stock one, inductor's CUDA-graph trees (mode="reduce-overhead")
1.035x, and forward, backward and optimizer in one graph (which a user's loop, calling the three itself,
cannot be given) 1.081x (``benchmarks/diag_train_graphs.py``, RESULTS.md, thirty-ninth session).

Why not torch.cuda.make_graphed_callables, which builds the same two graphs: its backward hands the
graph's own gradient buffers to autograd, which stores them as ``param.grad`` when that is None. The
next backward replays into those buffers, so with gradient accumulation (two backwards, one step) or
``zero_grad(set_to_none=False)``, ``param.grad`` and the new gradient are one tensor, and the sum is
twice the new gradient, silently. Here a ``.grad`` that is still the graph's buffer when the next
backward runs is copied out first. Also here, where it would be silent there:
- outputs are copied out of the graph (a loss kept from the last step keeps its value);
- a forward while an earlier forward still waits for its backward runs the compiled step without the
  graph (a replay would overwrite what that backward reads), and a backward whose forward was replayed
  over raises instead of computing from the newer forward's activations;
- the graph serves only the call form it was captured for: the inputs' shapes and dtypes, every
  module's training flag, grad mode, and the addresses of the parameters and buffers (``param.data =
  ...`` or ``load_state_dict(assign=True)`` moves them). Any other call runs the compiled step.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .._log import warn_once
from ..captured import captured
from ..inputs import flatten, map_tensors, signature
from ..modelutil import PLAIN, first_line, is_oom


class GraphedStep:
    """Calls ``fn`` (the compiled step of ``model``, on a CUDA ``device``) through a forward and a
    backward CUDA graph captured at the first call that can be captured (see the module's docstring)."""

    def __init__(self, fn, model: nn.Module, device: torch.device):
        if device.index is None:  # "cuda" is not equal to an input's "cuda:0"
            device = torch.device(device.type, torch.cuda.current_device())
        self.fn, self.model, self.device = fn, model, device
        self.notes: list[str] = []  # why calls run without the graph
        self.strict = True  # while tk.optimize verifies and times it: a failed capture is the candidate's failure
        self._gen = 0  # forwards replayed so far, never reset: a backward knows whether its forward was the last
        self.reset()

    def reset(self) -> None:
        """Drop the graphs (and their memory); the next call captures again."""
        self._entry = None
        self._failed = False
        self._pending = None  # a weak reference to the autograd node of a replayed forward owed its backward

    def __call__(self, *args, **kwargs):
        entry = self._entry
        if entry is None:
            if self._failed or self._uncapturable(args, kwargs) is not None:
                return self.fn(*args, **kwargs)
            try:
                entry = self._entry = _Entry(self, args, kwargs)
            except Exception as e:
                if self.strict or is_oom(e):
                    raise
                self._failed = True
                self.notes.append(f"capture failed: {type(e).__name__}: {first_line(e)}")
                warn_once(f"graphed:{id(self)}", f"torchkiln: the training step's CUDA graph capture failed "
                          f"({self.notes[-1]}); the compiled step runs without it", owner=self)
                return self.fn(*args, **kwargs)
        elif entry.key != self._key(args, kwargs) or self._owed():
            return self.fn(*args, **kwargs)
        return entry.call(args, kwargs)

    def _owed(self) -> bool:
        """A replayed forward's backward has not run and its autograd graph is still alive."""
        if self._pending is not None and self._pending() is None:
            self._pending = None
        return self._pending is not None

    def _key(self, args, kwargs) -> tuple:
        m = self.model
        return (signature(args, kwargs), torch.is_grad_enabled(), tuple(x.training for x in m.modules()),
                tuple((p.data_ptr(), p.requires_grad) for p in m.parameters()),
                tuple(b.data_ptr() for b in m.buffers()))

    def _uncapturable(self, args, kwargs) -> str | None:
        if not torch.is_grad_enabled():
            return "grad mode is off"
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor):
                if v.device != self.device or v.requires_grad:
                    return "an input on another device, or one that requires grad"
            elif type(v) not in PLAIN:
                return f"a {type(v).__name__} argument"
        if not any(p.requires_grad for p in self.model.parameters()):
            return "no trainable parameter"
        return None


class _Entry:
    """The two graphs of one call form, and the autograd function that replays them."""

    def __init__(self, owner: GraphedStep, args, kwargs):
        self.owner = owner
        fn, dev = owner.fn, owner.device
        self.params = [p for p in owner.model.parameters() if p.requires_grad]

        def static(t):  # with the caller's strides: the compiled code was specialised on them
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)

        self.args = [static(a) if isinstance(a, torch.Tensor) else a for a in args]
        self.kwargs = {k: static(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm calls off the capture, as torch.cuda.graphs' docs ask
            for _ in range(2):
                self._grads(fn(*self.args, **self.kwargs), None)
        torch.cuda.current_stream(dev).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with captured(self.fwd, pool):
            self.out = fn(*self.args, **self.kwargs)
        self.outs = flatten(self.out)
        self.diff = [t.requires_grad for t in self.outs]
        self.grad_outs = [torch.zeros_like(t) for t, d in zip(self.outs, self.diff, strict=True) if d]
        self.zeroed = [True] * len(self.grad_outs)  # an output with no gradient (logits beside a loss): zeros once
        with captured(self.bwd, pool):
            self.grads = self._grads(self.out, self.grad_outs)
        self.key = owner._key(args, kwargs)

    def _grads(self, out, grad_outs):
        outs = [t for t in flatten(out) if t.requires_grad]
        if grad_outs is None:
            grad_outs = [torch.ones_like(t) for t in outs]
        return torch.autograd.grad(outs, self.params, grad_outs, allow_unused=True)

    def call(self, args, kwargs):
        for s, a in zip(self.args, args, strict=True):
            if isinstance(s, torch.Tensor):
                s.copy_(a, non_blocking=True)
        for k, s in self.kwargs.items():
            if isinstance(s, torch.Tensor):
                s.copy_(kwargs[k], non_blocking=True)
        flat = _Replay.apply(self, *self.params)
        by_id = {id(s): t for s, t in zip(self.outs, flat, strict=True)}
        return map_tensors(lambda s: by_id[id(s)], self.out)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry: _Entry, *params):
        owner = entry.owner
        owner._gen += 1
        ctx.entry, ctx.gen = entry, owner._gen
        # owed a backward while its autograd graph lives (the outputs alone say nothing: a loss keeps the
        # graph, not the logits it was computed from)
        owner._pending = weakref.ref(ctx)
        entry.fwd.replay()
        flat = tuple(t.clone() for t in entry.outs)  # a kept output keeps its value past the next replay
        ctx.mark_non_differentiable(*[t for t, d in zip(flat, entry.diff, strict=True) if not d])
        return flat

    @staticmethod
    def backward(ctx, *grads):
        entry = ctx.entry
        owner = entry.owner
        if ctx.gen != owner._gen:
            raise RuntimeError("torchkiln: this backward's forward was replayed over by a later forward of the "
                               "CUDA-graphed step (a graph kept with retain_graph across another forward); call "
                               "each backward before the next forward, or pass graph_mode=False to tk.optimize")
        owner._pending = None
        i = 0
        for g, d in zip(grads, entry.diff, strict=True):
            if d:
                target = entry.grad_outs[i]
                if g is None:
                    if not entry.zeroed[i]:
                        target.zero_()
                        entry.zeroed[i] = True
                else:
                    if g.data_ptr() != target.data_ptr():
                        target.copy_(g)
                    entry.zeroed[i] = False
                i += 1
        # A .grad that is still this graph's buffer (gradient accumulation, zero_grad(set_to_none=False)) is
        # copied out before the replay writes the new gradient there: accumulating a buffer into itself
        # doubled it (torch.cuda.make_graphed_callables' case, the module docstring).
        for p, g in zip(entry.params, entry.grads, strict=True):
            if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()
        entry.bwd.replay()
        return (None, *[g.detach() if g is not None else None for g in entry.grads])
