"""Change a module's tensors by making new ones, never by writing into old ones.

``Module.to()``, ``.float()`` and friends assign ``param.data`` in place, which
also changes every other module holding that Parameter: optimize() shares
untouched tensors with the caller's model, so passes must use this instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def remake(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
    """Replace each parameter and buffer ``t`` with ``fn(t)`` where that is a new tensor."""
    mods = module.modules() if recurse else (module,)
    for mod in mods:
        for key, p in list(mod._parameters.items()):
            if p is not None:
                d = p.detach()
                new = fn(d)
                if new is not d:
                    mod._parameters[key] = nn.Parameter(new, requires_grad=p.requires_grad)
        for key, b in list(mod._buffers.items()):
            if b is not None:
                new = fn(b)
                if new is not b:
                    mod._buffers[key] = new
    return module


def floating(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Apply ``fn`` to floating tensors only (integer buffers such as BN's counter stay)."""
    return lambda t: fn(t) if t.is_floating_point() else t
