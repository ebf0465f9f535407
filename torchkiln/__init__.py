"""torchkiln: make a PyTorch model fast on whatever hardware it runs on, with one call.

    import torchkiln as tk
    model = tk.optimize(model, dtype=torch.bfloat16)                      # inference
    model, opt = tk.optimize(model.train(), optimizer=opt, dtype=torch.bfloat16)  # training

This file is the whole public API. Importing it has no side effects: no logging
configuration, no torch settings, no environment changes.
"""

__version__ = "0.1.0"

from . import amp, optim  # noqa: E402
from .bench import bench  # noqa: E402
from .check import check  # noqa: E402
from .hardware import default_device, detect, devices  # noqa: E402
from .optimize import KilnModule, optimize, report  # noqa: E402
from .recipe import Recipe  # noqa: E402

__all__ = ["__version__", "detect", "devices", "default_device", "optimize", "report", "check", "bench",
           "KilnModule", "Recipe", "amp", "optim"]
