"""Keeping freed CPU memory for reuse: glibc malloc, in this process (CPU training).

Why: glibc serves every block over 32 MiB (and smaller ones at the heap's top, past its trim
threshold) with a fresh mmap, and gives it back on free. A CPU training step allocates the same
large tensors every step (logits, a vocabulary-sized embedding gradient, parameter gradients), so
each step faults its pages in again, 4 KiB at a time, and the kernel zeroes them. Measured on a
2-core Zen 4, bert-base bs8 seq128 bf16 (`benchmarks/diag_page_faults.py`; RESULTS.md, eleventh
session): the stock compiled step took 240,000 minor faults and 0.82 s of kernel time a step (of
3.6 s); torchkiln's 150,000 and 0.26 s (of 2.4 s). With the two settings below: no faults.

The settings: no mmap for single blocks (M_MMAP_MAX = 0: large blocks come from the heap and go
back to its free lists) and no trimming below 1 GiB free at the top (M_TRIM_THRESHOLD). torch's
`run_cpu` launcher and `torchkiln run` get the same by preloading jemalloc with
`oversize_threshold:1` (runtime/preload.py); this is the in-process form, for a user who starts
`python train.py`. The cost: the process keeps its peak heap instead of returning it, as jemalloc
or CUDA's caching allocator do. It is process-wide, so it is applied only where the training plan
says so (TrainRecipe.allocator), once, and reported; glibc offers no way to read the old values back.
"""

from __future__ import annotations

import ctypes
import platform
import threading

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_BYTES = 1 << 30

_LOCK = threading.Lock()
_DONE: str | None = None  # what keep_freed_memory() set, once it has


def why_not() -> str | None:
    """None when glibc's malloc serves this process; otherwise why the settings would do nothing."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"the C library here is not glibc ({platform.system()} {platform.libc_ver()[0] or 'unknown'})"
    maps = _maps()
    for lib in ("jemalloc", "tcmalloc"):
        if f"lib{lib}" in maps:
            return f"{lib} is loaded (it replaces glibc's malloc and keeps freed memory itself)"
    return None


def _maps() -> str:
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return ""


def keep_freed_memory() -> str:
    """Apply the settings (once per process); returns what was set. Raises OSError where it cannot."""
    global _DONE
    with _LOCK:
        if _DONE is not None:
            return _DONE
        reason = why_not()
        if reason:
            raise OSError(reason)
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)):
            raise OSError("glibc's mallopt refused the settings")
        _DONE = ("glibc malloc keeps freed memory for reuse (process-wide: mallopt M_MMAP_MAX=0, "
                 "M_TRIM_THRESHOLD=1 GiB)")
        return _DONE
