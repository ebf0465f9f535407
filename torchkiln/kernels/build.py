"""Compiling torchkiln's own C++ sources on first use, into a per-machine cache.

Shared by the kernels here (``cpu_gemv``, ``weight_watch``, ``cuda_int4``): each is built once per source, torch
version, Python and compiler, under ``$XDG_CACHE_HOME/torchkiln/kernels`` (``~/.cache/...``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("torchkiln")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchkiln" / "kernels"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++")


def nvcc() -> str | None:
    """CUDA's compiler: ``$CUDA_HOME/bin/nvcc``, else the one on PATH, else /usr/local/cuda's."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for path in ([os.path.join(home, "bin", "nvcc")] if home else []) + [shutil.which("nvcc") or "",
                                                                         "/usr/local/cuda/bin/nvcc"]:
        if path and os.access(path, os.X_OK):
            return path
    return None


def command(cxx: str, source: Path, out: Path, flags: list[str], libs: list[str], python: bool = False) -> list[str]:
    """The compile-and-link line against torch's headers and libraries (and Python's, for an
    extension module). ``cxx`` may be nvcc (for a .cu source), which takes the host compiler's and
    linker's options through -Xcompiler / -Xlinker."""
    from torch.utils import cpp_extension

    include = [f"-I{p}" for p in cpp_extension.include_paths()]
    if python:
        include.append(f"-I{sysconfig.get_paths()['include']}")
    cuda = os.path.basename(cxx).startswith("nvcc")
    rpath = ["-Xlinker", "-rpath", "-Xlinker"] if cuda else []
    dirs = [arg for p in cpp_extension.library_paths()
            for arg in (f"-L{p}", *rpath, p if cuda else f"-Wl,-rpath,{p}")]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    pic = ["-Xcompiler", "-fPIC"] if cuda else ["-fPIC"]
    return [cxx, "-O3", *flags, "-shared", *pic, "-std=c++17", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *include, str(source), "-o", str(out), *dirs, *libs]


def build(source: Path, flags: list[str], libs: list[str], python: bool = False) -> Path:
    """The cached library for this source, torch, Python and compiler, compiled if missing (to a
    temporary name, then renamed: two processes building at once both end with a whole file). A
    ``.cu`` source is compiled by nvcc."""
    cxx = nvcc() if source.suffix == ".cu" else compiler()
    if cxx is None:
        what = "CUDA compiler found (nvcc; set CUDA_HOME)" if source.suffix == ".cu" else \
            f"C++ compiler found ({os.environ.get('CXX') or 'c++'} is not on PATH)"
        raise RuntimeError(f"no {what}")
    key = hashlib.sha256(b"\0".join([source.read_bytes(), torch.__version__.encode(), os.path.realpath(cxx).encode(),
                                     " ".join(flags + libs).encode(),
                                     (sysconfig.get_config_var("EXT_SUFFIX") or "").encode()])).hexdigest()[:16]
    path = cache_dir() / f"{source.stem}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("torchkiln: compiling %s (once per machine, torch and Python; seconds, up to a minute for CUDA) "
             "into %s", source.name, path.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(command(cxx, source, Path(tmp), flags, libs, python), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"compiling {source.name} failed: {done.stderr.strip()[-800:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
