"""Have the original's forward hooks changed since the optimized form was built?

A traced, compiled or copied model does not call hooks registered on the original's modules
afterwards: a feature-extraction hook never fired and a pre-hook that edits the input was ignored,
so the output was silently wrong (the twenty-eighth session's probes, benchmarks/RESULTS.md).
While the hooks differ from those the served form was built with, calls run the original itself.

The check runs on every call. Hooks are added through ``torch.utils.hooks.RemovableHandle``, whose
class-wide counter grows with every registration anywhere in the process, so the common answer
(nothing registered since the last look, and no hooked dict emptied) costs one attribute read and
the lengths of the dicts that held hooks. Only when the counter moved is every module's dict read
again. Not seen: hooks written into a module's dicts directly, bypassing ``register_*_hook``.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from .modelutil import inert_hook

_GLOBAL = ("_global_forward_hooks", "_global_forward_pre_hooks")


class HookWatch:
    def __init__(self, model: nn.Module):
        self._dicts = [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._dicts += [d for d in (getattr(_module, g, None) for g in _GLOBAL) if isinstance(d, dict)]
        self._built: tuple | None = None  # the hooks the served form was built with
        self._look = (-1, [], (), ())  # (counter, dicts holding hooks, their lengths, the hooks) at the last look

    def _now(self) -> tuple:
        look = self._look
        counter = RemovableHandle.next_id
        if counter == look[0] and tuple(map(len, look[1])) == look[2]:
            return look[3]
        held = [d for d in self._dicts if d]
        # a dict's keys are its handles' ids; transformers' output capture, installed by a call, is no change
        hooks = tuple((id(d), ks) for d in held if (ks := tuple(k for k, h in d.items() if not inert_hook(h))))
        self._look = (counter, held, tuple(map(len, held)), hooks)
        return hooks

    def remember(self) -> None:
        self._built = self._now()

    def changed(self) -> bool:
        """Do the hooks differ from those at ``remember()``? (False before it.)"""
        return self._built is not None and self._now() != self._built
