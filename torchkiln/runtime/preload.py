"""Finding the libraries `torchkiln run` may LD_PRELOAD: jemalloc or tcmalloc, and Intel's libiomp5.

A library is preloaded only when found, and only when it is an ELF file for this interpreter's
machine and word size: a 32-bit copy from `ldconfig -p`, or a linker-script `.so`, would make the
dynamic loader print an error into every instance's output and be ignored anyway.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# Preference order within a kind: the versioned runtime names exist without the -dev package.
NAMES = {
    "tcmalloc": ("libtcmalloc.so.4", "libtcmalloc.so", "libtcmalloc_minimal.so.4", "libtcmalloc_minimal.so"),
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "iomp": ("libiomp5.so",),
}
# What to install when one is missing.
PACKAGES = {
    "tcmalloc": "Debian/Ubuntu: apt install libtcmalloc-minimal4; conda: gperftools; Fedora: gperftools-libs",
    "jemalloc": "Debian/Ubuntu: apt install libjemalloc2; conda: jemalloc; Fedora: jemalloc",
    "iomp": "pip install intel-openmp, or conda install intel-openmp",
}
# auto tries tcmalloc first, as ipexrun and torch's run_cpu do, so a move from them keeps the allocator.
ALLOCATORS = ("tcmalloc", "jemalloc")
# jemalloc keeps freed pages instead of returning them at once: tensors of the same sizes come back
# every step, and each madvise/page fault round trip costs more than the memory. run_cpu's setting.
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto"


def parse_ldconfig(text: str) -> dict[str, list[str]]:
    """`ldconfig -p` lines ("libjemalloc.so.2 (libc6,x86-64) => /lib/.../libjemalloc.so.2") -> name: paths."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        name, sep, path = line.strip().partition(" => ")
        if sep:
            found.setdefault(name.split(" ")[0], []).append(path.strip())
    return found


@functools.lru_cache(maxsize=1)
def _ldconfig_text() -> str:
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if not exe:
        return ""
    try:
        return subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def env_dirs(env: Mapping[str, str] | None = None) -> list[str]:
    """The active environment's lib folders: a conda- or pip-installed library is the one meant."""
    env = os.environ if env is None else env
    prefixes = [env.get("CONDA_PREFIX"), env.get("VIRTUAL_ENV"), sys.prefix, os.path.expanduser("~/.local")]
    return list(dict.fromkeys(os.path.join(p, "lib") for p in prefixes if p))


def system_dirs() -> list[str]:
    multiarch = getattr(sys.implementation, "_multiarch", None)  # x86_64-linux-gnu on Debian
    dirs = ["/usr/local/lib", "/usr/local/lib64"]
    if multiarch:
        dirs += [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"]
    return dirs + ["/usr/lib64", "/usr/lib", "/lib64", "/lib"]


def _elf_signature(path: str) -> tuple[bytes, bytes] | None:
    """(class+endianness, machine) of an ELF file, None for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return head[4:6], head[18:20]


def _loadable(path: str) -> bool:
    mine = _elf_signature(sys.executable)
    theirs = _elf_signature(path)
    return theirs is not None and (mine is None or theirs == mine)


def find_library(kind: str, dirs: Sequence[str] | None = None, system: Sequence[str] | None = None,
                 ldconfig: str | None = None) -> str | None:
    """The path of library `kind` ("tcmalloc", "jemalloc", "iomp") or None. Searched: `dirs` (default: the
    environment's lib folders), the loader's cache (`ldconfig` is the text of `ldconfig -p`), then `system`
    (default: the usual system folders). Tests pass their own."""
    names = NAMES[kind]
    first = env_dirs() if dirs is None else dirs
    last = system_dirs() if system is None else system
    cache = parse_ldconfig(_ldconfig_text() if ldconfig is None else ldconfig)
    candidates = [os.path.join(d, n) for d in first for n in names]
    candidates += [p for n in names for p in cache.get(n, [])]
    candidates += [os.path.join(d, n) for d in last for n in names]
    return next((p for p in candidates if Path(p).is_file() and _loadable(p)), None)
