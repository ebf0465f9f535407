"""torchkiln: make a PyTorch model fast on whatever hardware it runs on, with one call.

    import torchkiln as tk
    model = tk.optimize(model, dtype=torch.bfloat16)                      # inference
    model, opt = tk.optimize(model.train(), optimizer=opt, dtype=torch.bfloat16)  # training

This file is the whole public API. Importing it has no side effects: no logging
configuration, no torch settings, no environment changes.

The names load on first use: importing torch takes about 2 s on a small machine,
and the launcher (`torchkiln run --dry-run`, which must answer in under a second)
and `torchkiln --version` need none of it.
"""

import importlib
import types

__version__ = "0.1.0"

# public name -> (module, attribute; None: the module itself)
_EXPORTS = {
    "optimize": (".optimize", "optimize"),
    "report": (".optimize", "report"),
    "refresh": (".optimize", "refresh"),
    "KilnModule": (".optimize", "KilnModule"),
    "check": (".check", "check"),
    "bench": (".bench", "bench"),
    "detect": (".hardware", "detect"),
    "devices": (".hardware", "devices"),
    "default_device": (".hardware", "default_device"),
    "Recipe": (".recipe", "Recipe"),
    "amp": (".amp", None),
    "optim": (".optim", None),
    "runtime": (".runtime", None),
    "quantize": (".quantization", "quantize"),
    "quantization": (".quantization", None),
    "llm": (".llm", None),
}

__all__ = ["__version__", *_EXPORTS]


def _resolve(name: str):
    module, attr = _EXPORTS[name]
    mod = importlib.import_module(module, __name__)
    return mod if attr is None else getattr(mod, attr)


class _Package(types.ModuleType):
    # tk.optimize, tk.check, tk.bench and tk.report share their names with submodules; once
    # a submodule is imported Python sets it as the package attribute, so these four always
    # resolve to the function, never to the module.
    _SHADOWED = frozenset({"optimize", "check", "bench", "report"})

    def __getattribute__(self, name: str):
        if name in _Package._SHADOWED:
            return _resolve(name)
        return super().__getattribute__(name)

    def __getattr__(self, name: str):
        if name in _EXPORTS:
            return _resolve(name)
        raise AttributeError(f"module 'torchkiln' has no attribute {name!r}")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(__all__))


import sys  # noqa: E402

sys.modules[__name__].__class__ = _Package
del sys
