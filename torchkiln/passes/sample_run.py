"""Run a model once on a sample with forward pre-hooks on its nn.Linear modules:
how passes learn dataflow (which input each layer gets) that the module tree hides."""

from __future__ import annotations

import torch
from torch import nn


def run_with_linear_hooks(model: nn.Module, args: tuple, kwargs: dict, record, select=None) -> None:
    """``record(name, module, input_tensor)`` is called on each exact nn.Linear's first call (or each
    module ``select`` accepts)."""
    seen: set = set()

    def make(name):
        def hook(mod, inp):  # returns None: a pre-hook's return value would replace the input
            if inp and mod not in seen:
                seen.add(mod)
                record(name, mod, inp[0])
        return hook

    select = select or (lambda m: type(m) is nn.Linear)
    hooks = [m.register_forward_pre_hook(make(n)) for n, m in model.named_modules() if select(m)]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
