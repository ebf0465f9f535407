"""Has any of a model's weights changed since the optimized form was built from them?

A served candidate that holds its own copy of the weights (a cast, a frozen compiled graph) has to
notice when the original's change, or it answers from the old ones. Every weight *slot* (a
module's ``_parameters`` or ``_buffers`` entry) is checked on each call for:

- another object in the slot (``m.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``);
- a version bump (an in-place write PyTorch sees: ``with torch.no_grad(): p.mul_(...)``, an
  optimizer step, ``load_state_dict``);
- a new storage pointer (``p.data = t``, which keeps the version);
- another module in a submodule slot (``model.fc = nn.Linear(...)``);
- another value in a plain attribute (``model.temperature = 0.5``, ``model.use_relu = True``,
  a submodule's ``training`` flag, a value in a settings object such as a transformers config:
  ``model.config.output_hidden_states = True``): a traced, compiled or copied form read it once, when built. Plain
  tensor attributes (``self.scale = torch.tensor(2.0)``, not a registered buffer) are watched as
  weights are.

Not seen: in-place writes through ``p.data`` (``p.data.mul_(2)``, ``p.data.copy_(t)``). ``p.data``
is a new tensor with its own version counter, so nothing on ``p`` records the write. Nor in-place
writes to weights made under ``torch.inference_mode()``: inference tensors have no version counter
(a new tensor in the slot, or ``p.data = t``, is still seen). After such writes call
``tk.refresh(model)``.

The check runs on every call, so its cost matters: in C (``kernels/weight_watch.cpp``) where it
can be built, else the same test in Python.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import nn

from .modelutil import plain_attrs, setting_attrs, settings, tensor_attrs, version

log = logging.getLogger("torchkiln")
_VERSION, _PTR = operator.attrgetter("_version"), torch.Tensor.data_ptr
_warned = []


class WeightWatch:
    def __init__(self, model: nn.Module):
        modules = list(model.modules())
        slots = [(d, k) for m in modules for d in (m._parameters, m._buffers) for k, t in d.items() if t is not None]
        slots += [(vars(m), k) for m in modules for k in tensor_attrs(m)]
        self._dicts, self._keys = [d for d, _ in slots], [k for _, k in slots]
        # Slots watched for identity only. Submodules: a layer swapped after optimize (model.fc =
        # nn.Linear(...)) brings weights no tensor slot above holds; it served the old layer's answers
        # before. Plain attributes: a flag or scale set after optimize was ignored by every traced or
        # compiled form but the stock compile (whose guards see it), silently (the twenty-eighth
        # session's probes).
        mods = [(m._modules, k) for m in modules for k in m._modules]
        mods += [(vars(m), k) for m in modules for k in plain_attrs(m)]
        # Settings objects' plain values likewise (``model.config.output_hidden_states = True``).
        objs = settings(model)
        mods += [(vars(o), k) for o in objs for k in setting_attrs(o)]
        self._mod_dicts, self._mod_keys = [d for d, _ in mods], [k for _, k in mods]
        # Every dict a slot lives in, for the C check's version-tag shortcut (weight_watch.cpp)
        dicts = [d for m in modules for d in (m._parameters, m._buffers, m._modules, vars(m))] + [vars(o) for o in objs]
        self._tag_dicts = list({id(d): d for d in dicts}.values())
        # remember()'s snapshot, one tuple assigned at once, so a call checking on another thread
        # never pairs one snapshot's tensors with another's versions:
        # (dicts, keys, what they held: tensors then identity-only slots, the tensors' (version, pointer)
        #  state, the C module or None, how many tensors, the dicts' version tags or None)
        self._seen: tuple | None = None

    @property
    def native(self) -> bool:
        """Does ``changed()`` run the C check?"""
        return self._seen is not None and self._seen[4] is not None

    def ignore(self, tensors, attrs=()) -> None:
        """Stop watching the slots that hold these tensors, and these plain attributes ((module
        ``__dict__``, name) pairs): state the model updates itself, such as a call counter, not
        weights or settings. Takes effect at the next ``remember()``."""
        own = {id(t) for t in tensors}
        kept = [(d, k) for d, k in zip(self._dicts, self._keys, strict=True) if id(d.get(k)) not in own]
        self._dicts, self._keys = [d for d, _ in kept], [k for _, k in kept]
        gone = {(id(d), k) for d, k in attrs}
        kept = [(d, k) for d, k in zip(self._mod_dicts, self._mod_keys, strict=True) if (id(d), k) not in gone]
        self._mod_dicts, self._mod_keys = [d for d, _ in kept], [k for _, k in kept]

    def remember(self, native: bool = True) -> None:
        """Take the snapshot ``changed()`` compares with. ``native``: build the C check if it is not
        built yet (a one-time compile; callers pass False where the check will not run per call)."""
        now = list(map(dict.get, self._dicts, self._keys))
        if not all(isinstance(t, torch.Tensor) for t in now):  # a slot emptied since: nothing to watch there
            kept = [(d, k, t) for d, k, t in zip(self._dicts, self._keys, now, strict=True)
                    if isinstance(t, torch.Tensor)]
            self._dicts, self._keys, now = [d for d, _, _ in kept], [k for _, k, _ in kept], [t for *_, t in kept]
        c = _native(build=native)
        tags = c.tags(self._tag_dicts) if c is not None else None  # read before the slots: see weight_watch.cpp
        try:
            state = c.snapshot(now) if c is not None else None
        except RuntimeError as e:  # not expected (the C form handles what it knows): Python answers alike
            log.info("torchkiln: the C weight check failed (%s); using the Python form", e)
            c = state = tags = None
        if c is None:
            state = (_versions(now), list(map(_PTR, now)))
        # tensor slots first, then the identity-only ones (submodules, plain attributes): the C form's layout
        mods = list(map(dict.get, self._mod_dicts, self._mod_keys))
        self._seen = (self._dicts + self._mod_dicts, self._keys + self._mod_keys, now + mods, state, c, len(now), tags)

    def changed(self) -> bool:
        """Has any slot changed since ``remember()``? (False before it: nothing to compare with.)"""
        seen = self._seen
        if seen is None:
            return False
        dicts, keys, objs, state, c, n, tags = seen
        if c is not None:
            return c.changed(dicts, keys, objs, state, self._tag_dicts, tags)
        now = list(map(dict.get, dicts, keys))
        # map() over C getters: 31 us for bert-base's 201 tensors on a 2-core Zen 4, hot; 144-240 us
        # for mobilenet-v2's 312 right after a call (the C form: 30-47)
        if not all(map(operator.is_, now, objs)):
            return True
        return (_versions(now[:n]), list(map(_PTR, now[:n]))) != state


def _versions(tensors: list) -> list[int]:
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:  # inference tensors (made under torch.inference_mode()) have no version counter
        return list(map(version, tensors))


def _native(build: bool):
    """The C module, or None (logged once, with why). ``build``: compile it if not done yet."""
    from .kernels import weight_watch

    if not build and not weight_watch.load.cache_info().currsize:
        return None
    module, why = weight_watch.load()
    if module is None and not _warned:
        _warned.append(why)
        log.info("torchkiln: the weight-change check runs in Python (%s)", why)
    return module
