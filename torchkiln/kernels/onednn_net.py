"""Loading ``onednn_net.cpp`` (torchkiln's int8 CNN runner on oneDNN's primitives) through ctypes.

It links the oneDNN of pip's ``onednn-cpu-gomp`` wheel (with ``onednn-devel-cpu-gomp`` for the
headers: ``pip install "torchkiln[onednn]"``), because torch's wheel keeps its own oneDNN private.
That build threads with GNU OpenMP, and its ``libgomp.so.1`` resolves to the one torch has already
loaded, so both share one thread pool and ``torch.set_num_threads``. The library is compiled on first
use (about a second: the source includes no torch headers) and cached like the other kernels
(``kernels/build.py``). Where any of it is missing, ``load()`` says why and callers keep torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import site
import sys
import threading
from pathlib import Path

import torch

from . import build

SOURCE = Path(__file__).with_name("onednn_net.cpp")
_lock = threading.Lock()
_I64P = ctypes.POINTER(ctypes.c_int64)


def roots() -> list[Path]:
    """Where pip puts the wheel's ``lib/`` and ``include/``: $TORCHKILN_ONEDNN_ROOT, else this
    environment's prefix, then the user site's base."""
    env = os.environ.get("TORCHKILN_ONEDNN_ROOT")
    return [Path(env)] if env else [Path(sys.prefix), Path(site.getuserbase())]


def find() -> tuple[Path, Path] | str:
    """(lib dir, include dir) of a oneDNN 3.x with headers, or why there is none."""
    for root in roots():
        lib, inc = root / "lib", root / "include"
        if (lib / "libdnnl.so.3").exists() and (inc / "oneapi" / "dnnl" / "dnnl.hpp").exists():
            return lib, inc
    where = ", ".join(str(r) for r in roots())
    return (f"no oneDNN 3.x library with headers under {where} (pip install \"torchkiln[onednn]\", or set "
            "TORCHKILN_ONEDNN_ROOT)")


def _why_not_here() -> str | None:
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"Linux x86-64 only (this machine: {platform.system()} {platform.machine()})"
    if build.compiler() is None:
        return f"no C++ compiler found ({os.environ.get('CXX') or 'c++'} is not on PATH)"
    found = find()
    return found if isinstance(found, str) else None


def _built(source: Path, libs: list[str], opener) -> object | str:
    """``opener(path)`` of ``source`` compiled against this oneDNN (built if needed), or why not, in words.
    pip's oneDNN headers come first: torch ships headers of its own (private) oneDNN as well."""
    why = _why_not_here()
    if why:
        return why
    lib_dir, inc = find()
    with _lock:
        try:
            return opener(build.build(source, [f"-I{inc}"], [*libs, f"-L{lib_dir}", "-ldnnl", f"-Wl,-rpath,{lib_dir}"]))
        except (OSError, RuntimeError) as e:
            return f"build failed: {e}"


@functools.cache
def load() -> ctypes.CDLL | str:
    """The runner's library (built if needed), or why it cannot be had here, in words."""
    lib = _built(SOURCE, [], lambda path: ctypes.CDLL(str(path)))
    if isinstance(lib, str):
        return lib
    c_int, c_float, vp = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    sig = {
        "kn_new": (vp, []), "kn_free": (None, [vp]), "kn_error": (ctypes.c_char_p, [vp]),
        "kn_input": (c_int, [vp, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, c_float, c_int]),
        "kn_conv": (c_int, [vp, c_int, c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P,
                            ctypes.c_int64, vp, vp, vp, c_float, c_int, c_int]),
        "kn_pool": (c_int, [vp, c_int, c_int, _I64P, _I64P, _I64P, ctypes.c_int64, ctypes.c_int64]),
        "kn_output": (c_int, [vp, c_int, c_int]), "kn_finalize": (c_int, [vp]), "kn_run": (c_int, [vp, vp, vp]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def load_torch_op(source: Path) -> str | None:
    """Build and register a torch op library (``cpu_attention.cpp``, ``cpu_qlinear.cpp``) that calls
    this oneDNN from C++; None when its ops are registered, else why not, in words."""
    done = _built(source, ["-lc10", "-ltorch_cpu"], lambda path: torch.ops.load_library(str(path)))
    return done if isinstance(done, str) else None


def ints(*values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)
