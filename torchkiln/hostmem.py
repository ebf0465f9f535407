"""Host memory: what this process can still allocate, and what a candidate would take to build.

Why: optimize() builds its candidates side by side (each a cast copy, a traced copy, compiled
constants) to time them against each other. bert-base in bf16 on the CPU peaked at 2.6x its float32
weights above the model (a 2-core Zen 5, docs/optimize.md), where the stock recipe alone took 1.1x.
A model near the machine's memory then met the kernel's OOM killer inside optimize(), a crash with no
Python error, where eager would have run. A candidate that would not fit is now skipped, with its
reason in the report; CUDA candidates already step aside on torch's OutOfMemoryError.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch
from torch import nn

# Cast copy plus what compiling it keeps (freezing's constants, packed weights): the larger of the two
# shapes measured, bert-base bf16, 2.6x float32 weights for five candidates, about 0.5x-1x each.
COMPILED_COPIES = 2.0
MARGIN = 0.9  # of what is available: the activations, the compiler's own working memory


def available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process can still take: the kernel's MemAvailable, capped by the cgroup's limit
    (a container's memory limit is what its OOM killer enforces). None where neither is known."""
    free = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        try:
            import psutil
            free = psutil.virtual_memory().available
        except ImportError:
            pass
    room = _cgroup_room(cgroup)
    if room is not None:
        free = room if free is None else min(free, room)
    return free


def _cgroup_room(root: str) -> int | None:
    for limit, usage in (("memory.max", "memory.current"),  # cgroup v2
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        try:
            with open(os.path.join(root, limit)) as f:
                text = f.read().strip()
            if text == "max" or int(text) >= 1 << 60:  # no limit (v1 writes a huge number)
                return None
            with open(os.path.join(root, usage)) as f:
                return max(0, int(text) - int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return None


def build_bytes(model: nn.Module, dtype: torch.dtype, compiled: bool) -> int:
    """A generous estimate of what one candidate adds: the model's floating weights in ``dtype``, twice
    for a compiled one."""
    n = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
            for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    return int(n * (COMPILED_COPIES if compiled else 1.0))


def fits(need: int, free: int | None) -> bool:
    return free is None or need <= MARGIN * free


# Below this many bytes of weights, what a selection leaves is not worth the full garbage collection
# that finds it: 0.24 s with torch's compiler loaded (465k objects), against a 1.3 s optimize() of a
# small MLP (2-core Zen 5).
LARGE = 64 << 20


def worth_returning(model: nn.Module) -> bool:
    return sum(t.numel() * t.element_size() for t in model.parameters()) >= LARGE


def give_back() -> None:
    """Hand the heap the losing candidates freed back to the OS (glibc's malloc_trim). glibc keeps freed
    chunks below its mmap threshold (which rises to 32 MB after a large free) in the process: after
    optimize() on bert-base in bf16 the process stayed at 1.83 GB, 0.53 GB above what it held live
    (1.30 GB after the trim; stock torch.compile alone: 1.24). A container's memory limit counts it."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim  # absent on musl
    except (OSError, AttributeError):
        return None
