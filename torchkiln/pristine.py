"""What a call may change in place, kept so that choosing a candidate leaves no trace.

tk.optimize runs the original and each candidate several times on the caller's inputs
(reference, verification, timing). A model that updates a buffer in forward (a running
counter, an EMA), a plain attribute, or its input tensor in place would otherwise see
every one of those runs: a counter stood at 9 after tk.optimize and the caller's
sample_input had been doubled 7 times (the new-user sweep, 2026-11-22). A Pristine
snapshot is taken before those runs and put back before each of them and before the
one call the caller asked for, which then runs for real.
"""

from __future__ import annotations

import torch
from torch import nn

from . import inputs
from .modelutil import plain_attrs, tensor_attrs, version


class Pristine:
    def __init__(self, model: nn.Module, args, kwargs):
        # Clones are cheap next to the runs they protect (buffers are small beside the weights);
        # restore() copies back only what a run changed, found by version counter.
        # (plain tensor attributes count as buffers: a forward may keep state in them too)
        buffers = [*model.buffers(), *(vars(m)[k] for m in model.modules() for k in tensor_attrs(m))]
        self._tensors = [(t, version(t), t.detach().clone()) for t in [*buffers, *inputs.flatten((args, kwargs))]]
        self._attrs = [(m, {k: vars(m)[k] for k in plain_attrs(m)}) for m in model.modules()]
        self._n_buffers = len(buffers)
        # A forward that replaces a buffer (``self.n = self.n + 1``) leaves the old tensor untouched
        # and a new one in the slot: found by slot, not by version, and the old one put back.
        self._slots = [(f"{name}.{k}" if name else k, m._buffers, k, t) for name, m in model.named_modules()
                       for k, t in m._buffers.items() if t is not None]
        self.mutated: list[torch.Tensor] = []  # buffers a run changed: the model's own state
        self.mutated_attrs: list[tuple[dict, str]] = []  # plain attributes a run changed, as (module __dict__, name)
        self.replaced: list[str] = []  # buffers a run replaced with new tensors (qualified names)
        self.changed = False  # did any run change a buffer, an attribute or an input?

    def restore(self) -> None:
        for qualified, d, k, t in self._slots:
            if d.get(k) is not t:
                d[k] = t
                self.changed = True
                if qualified not in self.replaced:
                    self.replaced.append(qualified)
        with torch.no_grad():
            for i, (t, v, saved) in enumerate(self._tensors):
                if version(t) != v:
                    if i < self._n_buffers and not any(t is m for m in self.mutated):
                        self.mutated.append(t)
                    t.copy_(saved)
                    self.changed = True
                    self._tensors[i] = (t, version(t), saved)
        for m, saved in self._attrs:
            for k, v in saved.items():
                if vars(m).get(k, v) is not v:
                    vars(m)[k] = v
                    self.changed = True
                    if not any(d is vars(m) and n == k for d, n in self.mutated_attrs):
                        self.mutated_attrs.append((vars(m), k))
