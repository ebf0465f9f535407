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
from .modelutil import PLAIN, plain_attrs, setting_attrs, settings, tensor_attrs, version


class Pristine:
    def __init__(self, model: nn.Module, args, kwargs):
        # Clones are cheap next to the runs they protect (buffers are small beside the weights);
        # restore() copies back only what a run changed, found by version counter.
        # (plain tensor attributes count as buffers: a forward may keep state in them too)
        buffers = [*model.buffers(), *(vars(m)[k] for m in model.modules() for k in tensor_attrs(m))]
        self._tensors = [(t, version(t), t.detach().clone()) for t in [*buffers, *inputs.flatten((args, kwargs))]]
        self._attrs = [(m, {k: vars(m)[k] for k in plain_attrs(m)}) for m in model.modules()]
        self._attrs += [(o, {k: vars(o)[k] for k in setting_attrs(o)}) for o in settings(model)]
        # public attributes a run adds (``self.last_map = ...``) are taken away again
        self._public = [(m, {k for k in vars(m) if not k.startswith("_")}) for m in model.modules()]
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
        for m, keys in self._public:
            for k in [k for k in vars(m) if not k.startswith("_") and k not in keys]:
                del vars(m)[k]
                self.changed = True
        for m, saved in self._attrs:
            for k, v in saved.items():
                if vars(m).get(k, v) is not v:
                    vars(m)[k] = v
                    self.changed = True
                    if not any(d is vars(m) and n == k for d, n in self.mutated_attrs):
                        self.mutated_attrs.append((vars(m), k))


# torch's own bookkeeping in a module's __dict__: hooks and the registries, never state a forward keeps
_INTERNAL = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}


def state(model: nn.Module) -> dict:
    """What a forward can keep between calls, by qualified name: every attribute of every module
    (parameters and buffers by identity and version counter, other tensors likewise, plain values
    by value, other objects by identity). A list appended to in place is not seen."""
    out = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        items = [*m._parameters.items(), *m._buffers.items(),
                 *((k, v) for k, v in vars(m).items() if k not in _INTERNAL and "hook" not in k)]
        for k, v in items:
            if isinstance(v, torch.Tensor):
                token = ("tensor", id(v), version(v))
            elif type(v) in PLAIN:
                token = ("value", type(v), v)
            else:
                token = ("object", id(v))
            out[prefix + k] = token
    return out


def moved(before: dict, after: dict) -> list[str]:
    """Names whose state differs (added, removed, replaced, written in place or re-valued)."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def per_call_state(model: nn.Module, run) -> list[str]:
    """The state ``model``'s forward changes at every call, found by running it (``run``) once and,
    if anything moved, once more from where the first call left it: what moves again is kept per
    call (a counter, attention maps stored for later inspection); what a second call leaves alone
    was set up once (swin's ``shift_size``, a cache filled on first use) and needs no care.
    The caller restores the model afterwards (Pristine)."""
    s0 = state(model)
    run()
    s1 = state(model)
    if not moved(s0, s1):
        return []
    run()
    return moved(s1, state(model))
