"""Which OpenMP runtime torch uses, and so which affinity variables an instance needs.

libgomp (GNU; Linux pip wheels) reads GOMP_CPU_AFFINITY / OMP_PROC_BIND; libiomp5 (Intel) and LLVM's
libomp read KMP_AFFINITY / KMP_BLOCKTIME. Setting the other family's variables does nothing, silently.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

__all__ = ["classify", "detect_omp", "resolve_omp"]


def classify(path: str) -> str | None:
    """"gnu", "intel" or None for a shared library's path. LLVM's libomp counts as "intel": it is the
    same runtime (KMP_* variables)."""
    name = os.path.basename(path)
    if name.startswith("libiomp5") or re.match(r"libomp[.-]", name):
        return "intel"
    if name.startswith("libgomp"):
        return "gnu"
    return None


def _from_maps(text: str) -> tuple[str, str] | None:
    kinds = {}
    for line in text.splitlines():
        path = line.split()[-1] if line.split() else ""
        kind = classify(path)
        if kind:
            kinds.setdefault(kind, path)
    # A preloaded libiomp5 takes over libgomp's symbols, so it wins when both are mapped.
    for kind in ("intel", "gnu"):
        if kind in kinds:
            return kind, f"{os.path.basename(kinds[kind])} is loaded in this process"
    return None


def _torch_lib_dir() -> Path | None:
    # find_spec does not import torch: this stays cheap, and works before torch is imported.
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def detect_omp(maps: str | None = None, torch_lib: Path | None = None) -> tuple[str, str]:
    """(kind, evidence): the OpenMP runtime mapped into this process (torch is imported by the
    launcher), else the one torch ships next to its libraries, else GNU, Linux's default."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
    found = _from_maps(maps)
    if found:
        return found
    lib = _torch_lib_dir() if torch_lib is None else torch_lib
    if lib is not None and lib.is_dir():
        for path in sorted(lib.iterdir()):
            kind = classify(path.name)
            if kind:
                return kind, f"torch ships {path.name}"
    return "gnu", "no OpenMP library found; GNU is Linux's default"


def resolve_omp(requested: str, detected: tuple[str, str],
                iomp: str | None) -> tuple[str, str | None, list[str]]:
    """(kind to configure, library to preload or None, notes) for --omp auto|gnu|intel.

    `intel` when torch runs libgomp needs libiomp5 preloaded (it answers libgomp's symbols, as with
    ipexrun); without it the KMP_* variables would be ignored, so GNU settings are used instead.
    """
    kind, evidence = detected
    if requested == "auto":
        return kind, None, []
    if requested == "gnu":
        notes = [] if kind == "gnu" else [
            f"--omp gnu, but {evidence}: GOMP_CPU_AFFINITY is read only if that runtime honours it; "
            "the CPU binding (numactl/affinity) still applies"]
        return "gnu", None, notes
    if requested != "intel":
        raise ValueError(f"omp={requested!r}: use auto, gnu or intel")
    if kind == "intel":
        return "intel", None, []
    if iomp:
        return "intel", iomp, [f"--omp intel: preloading {iomp} in place of torch's libgomp"]
    from .preload import PACKAGES

    return "gnu", None, [f"--omp intel: libiomp5.so not found ({PACKAGES['iomp']}); using GNU OpenMP "
                         "settings, which torch's libgomp reads"]
