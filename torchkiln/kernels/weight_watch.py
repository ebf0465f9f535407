"""``_kiln_weight_watch``: the C form of the per-call weight-change check (weight_watch.cpp says why),
a Python extension module built on first use (``build.py``: about 7 s on 2 cores, once per machine,
torch and Python). Where it cannot be built, ``load()`` says why and ``torchkiln.watch`` keeps its
Python form, which answers the same.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import sysconfig
import threading
from pathlib import Path

from . import build

SOURCE = Path(__file__).with_name("weight_watch.cpp")
_lock = threading.Lock()


@functools.cache
def load():
    """(the module, None), or (None, why not in words)."""
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    if not headers.exists():  # slim images ship Python without its headers: say so, and compile nothing
        return None, f"Python's headers are not installed ({headers} is missing; e.g. apt install python3-dev)"
    with _lock:
        try:
            path = build.build(SOURCE, [], ["-lc10", "-ltorch_cpu", "-ltorch_python"], python=True)
            loader = importlib.machinery.ExtensionFileLoader("_kiln_weight_watch", str(path))
            spec = importlib.util.spec_from_file_location("_kiln_weight_watch", path, loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
        except (OSError, RuntimeError, ImportError) as e:
            return None, f"build failed: {e}"
    return module, None
