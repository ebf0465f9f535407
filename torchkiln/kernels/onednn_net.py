"""Loading and calling ``onednn_net.cpp`` (torchkiln's CNN runner on oneDNN's primitives) through
ctypes: a conv net as a ``Program`` (steps over value slots), built into one C ``Net`` per input
shape and called by a ``Runner`` module. Its front ends make the Program: the int8 one from a pt2e
graph (quantization/onednn_net.py), the float32 / bf16 one from a traced model (passes/onednn_conv_net.py).

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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..passes.onednn_graph import Unsupported
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


@functools.cache
def _preload(lib_dir: Path) -> None:
    """pip's libdnnl, loaded on its own before any library of ours that links it. Loaded instead as a
    dependency of a torch op library (cpu_attention, cpu_qlinear link libtorch_cpu), its weak C++
    symbols bind to the copies torch 2.6's libtorch_cpu exports from torch's own oneDNN
    (``std::vector<cpu_isa_t>``, the primitive cache's result type): later primitives then failed to
    build or corrupted the heap (RESULTS.md, "Forty-ninth session"; torch 2.13 exports fewer of them)."""
    ctypes.CDLL(str(lib_dir / "libdnnl.so.3"))


def _built(source: Path, libs: list[str], opener) -> object | str:
    """``opener(path)`` of ``source`` compiled against this oneDNN (built if needed), or why not, in words.
    pip's oneDNN headers come first: torch ships headers of its own (private) oneDNN as well."""
    why = _why_not_here()
    if why:
        return why
    lib_dir, inc = find()
    with _lock:
        try:
            _preload(lib_dir)
            return opener(build.build(source, [f"-I{inc}"], [*libs, f"-L{lib_dir}", "-ldnnl", f"-Wl,-rpath,{lib_dir}"]))
        except (OSError, RuntimeError) as e:
            return f"build failed: {e}"


@functools.cache
def load() -> ctypes.CDLL | str:
    """The runner's library (built if needed), or why it cannot be had here, in words."""
    # -fopenmp: the Winograd transforms' loops, on the libgomp torch and this oneDNN already share
    lib = _built(SOURCE, ["-fopenmp"], lambda path: ctypes.CDLL(str(path)))
    if isinstance(lib, str):
        return lib
    c_int, c_float, vp = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    sig = {
        "kn_new": (vp, [c_int, c_int]), "kn_free": (None, [vp]), "kn_error": (ctypes.c_char_p, [vp]),
        "kn_input": (c_int, [vp, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, c_float, c_int]),
        "kn_conv": (c_int, [vp, c_int, c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P,
                            ctypes.c_int64, vp, vp, vp, c_float, c_int, c_int, c_float, c_float]),
        "kn_pool": (c_int, [vp, c_int, c_int, _I64P, _I64P, _I64P, ctypes.c_int64, ctypes.c_int64]),
        "kn_output": (c_int, [vp, c_int, c_int]), "kn_finalize": (c_int, [vp]), "kn_run": (c_int, [vp, vp, ctypes.POINTER(vp)]),
        "kn_forms": (c_int, [vp, ctypes.POINTER(c_int), c_int]),
        "kn_times": (c_int, [vp, c_int, ctypes.POINTER(ctypes.c_double), c_int]),
        "kn_linear": (c_int, [vp, c_int, ctypes.c_int64, vp, vp]), "kn_scale": (c_int, [vp, c_int, c_int]),
        "kn_qlinear": (c_int, [vp, c_int, ctypes.c_int64, vp, vp, vp]),
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


@dataclass
class Conv:
    src: int
    other: int | None  # a residual added before the ReLU (oneDNN's sum post-op)
    weight: torch.Tensor  # OIHW: int8 codes, or float32 in a float program
    wscale: torch.Tensor | None  # int8: float32, one per output channel
    bias: torch.Tensor | None
    stride: tuple
    padding: tuple  # (h, w) on both sides, or (top, left, bottom, right)
    dilation: tuple
    groups: int
    scale: float  # int8: the output's quantization
    zp: int
    relu: bool
    clip: tuple | None = None  # (lo, hi): clamped after the sum instead (ReLU6 is (0, 6))
    eltwise: str | None = None  # "silu" or "sigmoid" after the sum instead

    def act(self) -> tuple:
        """kn_conv's (act, lo, hi): 0 none, 1 ReLU, 2 clamp, 3 SiLU, 4 sigmoid."""
        if self.eltwise:
            return {"silu": 3, "sigmoid": 4}[self.eltwise], 0.0, 0.0
        return (2, *self.clip) if self.clip else (int(self.relu), 0.0, 0.0)

    def activated(self) -> bool:
        return bool(self.relu or self.clip or self.eltwise)


@dataclass
class Pool:
    src: int
    avg: bool
    kernel: tuple | None  # None: adaptive, to `size`
    stride: tuple | None
    padding: tuple
    ceil: bool = False
    size: tuple | None = None


@dataclass
class Scale:
    """A float program's product of a (N, C, H, W) value and a (N, C, 1, 1) one (a squeeze-and-excite
    gate), in either order."""

    src: int
    other: int


@dataclass
class Linear:
    """A classifier head: flatten then Linear, on a (N, C, 1, 1) value. In an int8 program the weight
    is int8 codes with ``wscale`` per output feature, and the output float32 (the program's last)."""

    src: int
    weight: torch.Tensor  # (out_features, C): float32, or int8 codes in an int8 program
    bias: torch.Tensor | None
    wscale: torch.Tensor | None = None  # int8: float32, one per output feature


@dataclass
class Program:
    """A conv net as a list of steps over value slots (0: the input; step i makes slot i + 1); built
    into a C net per input shape by ``Net``. int8: the input is quantized with ``scale``/``zp``, and
    ``flat`` flattens the (N, C, 1, 1) output (as a float program ending in a ``Linear`` does). ``out``
    is one slot, or a tuple of them for a program with several outputs (a tuple of tensors). Float
    programs: ``winograd`` 1 runs each 3x3 stride-1 convolution in whichever of oneDNN's direct kernel,
    Winograd F(4x4, 3x3) and F(2x2, 3x3) timed fastest in the net (onednn_net.cpp says why); 0 the
    direct kernel only; 4 or 2 that form wherever it applies (tests)."""

    scale: float = 1.0
    zp: int = 0
    steps: list = field(default_factory=list)
    out: int | tuple = 0
    flat: bool = False
    dtype: str = "int8"  # int8 | float32 | bfloat16 (float32 in and out, bf16 between the layers)
    winograd: int = 1


class Net:
    """One input shape's C program; frees it with the object."""

    def __init__(self, lib, prog: Program, shape: tuple):
        code = {"int8": 0, "float32": 1, "bfloat16": 2}[prog.dtype]
        self.lib, self.handle = lib, lib.kn_new(code, prog.winograd)
        self.dtype = prog.dtype
        self.lock = threading.Lock()  # a net's buffers serve one call at a time
        try:
            self.steps = prog.steps
            self.out_shapes = self._build(prog, shape)
            self._check(lib.kn_finalize(self.handle))
        except Exception:
            lib.kn_free(self.handle)
            self.handle = None
            raise

    def _check(self, rc):
        if rc < 0:
            raise Unsupported(f"oneDNN: {self.lib.kn_error(self.handle).decode()}")
        return rc

    def _build(self, prog: Program, shape: tuple) -> tuple:
        """Adds every step to the C net; returns the output's shape and keeps each slot's (N, C, H, W)
        in ``self.dims``."""
        lib, h = self.lib, self.handle
        if len(shape) != 4:
            raise Unsupported(f"an input of shape {shape} (N, C, H, W only)")
        ids, dims = [self._check(lib.kn_input(h, *shape, prog.scale, prog.zp))], [tuple(shape)]
        for s in prog.steps:
            n, c, hh, ww = dims[s.src]
            if isinstance(s, Conv):
                kh, kw = s.weight.shape[2:]
                pt, pl, pb, pr = s.padding if len(s.padding) == 4 else (*s.padding, *s.padding)
                (sh, sw), (dh, dw) = s.stride, s.dilation
                out = (n, s.weight.shape[0], (hh + pt + pb - dh * (kh - 1) - 1) // sh + 1,
                       (ww + pl + pr - dw * (kw - 1) - 1) // sw + 1)
                other = -1 if s.other is None else ids[s.other]
                bias = None if s.bias is None else s.bias.data_ptr()
                ids.append(self._check(lib.kn_conv(h, ids[s.src], other, s.weight.shape[0], kh, kw, ints(sh, sw),
                                                   ints(pt, pl, pb, pr), ints(dh, dw), s.groups, s.weight.data_ptr(),
                                                   None if s.wscale is None else s.wscale.data_ptr(), bias, s.scale,
                                                   s.zp, *s.act())))
            elif isinstance(s, Scale):
                big, small = (s.src, s.other) if dims[s.other][2:] == (1, 1) else (s.other, s.src)
                if dims[small] != (*dims[big][:2], 1, 1):
                    raise Unsupported(f"a product of values shaped {dims[s.src]} and {dims[s.other]} (one (N, C, 1, 1) "
                                      "only)")
                ids.append(self._check(lib.kn_scale(h, ids[big], ids[small])))
                out = dims[big]
            elif isinstance(s, Linear):
                if hh * ww != 1:
                    raise Unsupported(f"a Linear on a flattened value of spatial size {(hh, ww)} (1 x 1 only)")
                bias = None if s.bias is None else s.bias.data_ptr()
                if s.wscale is None:
                    ids.append(self._check(lib.kn_linear(h, ids[s.src], s.weight.shape[0], s.weight.data_ptr(), bias)))
                else:
                    ids.append(self._check(lib.kn_qlinear(h, ids[s.src], s.weight.shape[0], s.weight.data_ptr(),
                                                          s.wscale.data_ptr(), bias)))
                out = (n, s.weight.shape[0], 1, 1)
            else:
                if s.kernel is None:
                    oh, ow = s.size
                    if hh % oh or ww % ow:
                        raise Unsupported(f"adaptive_avg_pool2d from {(hh, ww)} to {(oh, ow)} (divisors only)")
                    k, st, pad = (hh // oh, ww // ow), (hh // oh, ww // ow), (0, 0)
                else:
                    k, st, pad = s.kernel, s.stride, s.padding
                    oh, ow = (_pooled(hh, k[0], st[0], pad[0], s.ceil), _pooled(ww, k[1], st[1], pad[1], s.ceil))
                    if (oh, ow) == (1, 1) and pad == (0, 0) and k[0] >= hh and k[1] >= ww:
                        k = st = (hh, ww)  # one window over the whole input (EfficientNet's pooler): a global pool
                ids.append(self._check(lib.kn_pool(h, ids[s.src], int(s.avg), ints(*k), ints(*st), ints(*pad),
                                                   oh, ow)))
                out = (n, c, oh, ow)
            dims.append(out)
        self.dims, self.several = dims, isinstance(prog.out, tuple)
        shapes = []
        for slot in prog.out if self.several else (prog.out,):
            n, c, hh, ww = dims[slot]
            if prog.flat and hh * ww != 1:
                raise Unsupported(f"a flattened output of spatial size {(hh, ww)} (1 x 1 only)")
            self._check(lib.kn_output(h, ids[slot], int(prog.flat)))
            shapes.append((n, c) if prog.flat else (n, c, hh, ww))
        return shapes

    def __call__(self, x: torch.Tensor) -> torch.Tensor | tuple:
        """The output, or a tuple of them where the program has several (Program.out)."""
        x = x.contiguous()
        outs = [torch.empty(shape) for shape in self.out_shapes]
        ptrs = (ctypes.c_void_p * len(outs))(*[o.data_ptr() for o in outs])
        with self.lock:
            rc = self.lib.kn_run(self.handle, ctypes.c_void_p(x.data_ptr()), ptrs)
        if rc < 0:
            raise RuntimeError(f"torchkiln oneDNN {self.dtype} net: {self.lib.kn_error(self.handle).decode()}")
        return tuple(outs) if self.several else outs[0]

    def forms(self) -> list[int]:
        """Each op's form, in program order (the input's reorder, one per step, the output's): a
        convolution's Winograd output tile (4: F(4x4, 3x3), 2: F(2x2, 3x3)), 0 for one that could take
        Winograd but runs oneDNN's direct kernel (timed faster), -1 for the others."""
        n = len(self.steps) + 2
        out = (ctypes.c_int * n)()
        self.lib.kn_forms(self.handle, out, n)
        return list(out)

    def winograd(self) -> list[int]:
        """``forms()`` of the convolutions that could take Winograd, in graph order."""
        return [f for f in self.forms() if f >= 0]

    def times(self, calls: int = 10) -> list[float]:
        """Each op's least seconds over ``calls`` calls on a zero input, in program order: the input's
        reorder, then one per step, then the output's (benchmarks/diag_conv_net.py prints them)."""
        n = len(self.steps) + 2
        out = (ctypes.c_double * n)()
        with self.lock:
            self._check(self.lib.kn_times(self.handle, calls, out, n))
        return list(out)

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.kn_free(self.handle)
            self.handle = None


def _pooled(size: int, k: int, s: int, p: int, ceil: bool) -> int:
    """torch's pooled size (ceil mode: a last window must start inside the input or its left padding)."""
    out = (size + 2 * p - k + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


class Runner(nn.Module):
    """The program's region in the rewritten graph: float32 NCHW in, float32 out (dequantized, for int8)."""

    def __init__(self, prog: Program):
        super().__init__()
        self.prog, self.nets = prog, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a float program also takes a bf16 / fp16 model's own input, and answers in its dtype
        floats = (torch.float32,) if self.prog.dtype == "int8" else (torch.float32, torch.bfloat16, torch.float16)
        if x.dtype not in floats or x.device.type != "cpu":
            raise Unsupported(f"an input of {x.dtype} on {x.device} ({', '.join(map(str, floats))} on the CPU only)")
        net = self.nets.get(tuple(x.shape))
        if net is None:
            lib = load()
            if isinstance(lib, str):
                raise Unsupported(lib)
            net = self.nets[tuple(x.shape)] = Net(lib, self.prog, tuple(x.shape))
        # a bf16 program answers in bf16 (the head after it runs on bf16 copies: passes/onednn_conv_net.py)
        want = torch.bfloat16 if self.prog.dtype == "bfloat16" else x.dtype
        out = net(x if x.dtype == torch.float32 else x.float())
        if want == torch.float32:
            return out
        return tuple(o.to(want) for o in out) if isinstance(out, tuple) else out.to(want)


