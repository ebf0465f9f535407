"""kernels/onednn_net.cpp's input conversion (NCHW float32 -> the program's NHWC u8 codes, float32
or bf16), checked against torch's own arithmetic: a program with no steps returns its input through
that conversion and the output's (dequantize, or NHWC -> NCHW), so it must equal the pt2e graph's
quantize and dequantize (``quantized_decomposed``: the int8 net stands for that graph), ``x`` or
``x.bfloat16().float()``.

Where the CPU has AVX-512 (BW), one to four channels take the hand-written loop, which is exact,
rounding ties included. Five channels (and every count elsewhere) take oneDNN's reorder, which adds
the zero point before rounding (as torch 2.13's own ``quantize_per_tensor`` does) where the graph
rounds first: an exact tie may land one code away there, never more."""

import subprocess
import sys
import textwrap

import pytest
import torch

from torchkiln.hardware import detect
from torchkiln.kernels import onednn_net as kernel
from torchkiln.kernels.onednn_net import Net, Program

pytestmark = pytest.mark.skipif(isinstance(kernel.load(), str), reason=f"no oneDNN runner: {kernel.load()}")

SCALE, ZP = float(torch.tensor(0.0375)), 113  # a float32 scale, as observers make them


def through(x: torch.Tensor, dtype: str) -> torch.Tensor:
    prog = Program(scale=SCALE, zp=ZP, steps=[], out=0, dtype=dtype, winograd=0)
    return Net(kernel.load(), prog, tuple(x.shape))(x)


def inputs(channels: int) -> torch.Tensor:
    """Random values, values on exact rounding ties of the grid (nearest-even decides them), values
    past both ends of the u8 range, and a non-square odd size (a tile or row offset shows)."""
    g = torch.Generator().manual_seed(channels)
    x = torch.randn(2, channels, 7, 37, generator=g) * 3
    ties = (torch.randint(-130, 130, (x.numel() // 3,), generator=g).float() + 0.5) * SCALE
    x.view(-1)[: ties.numel()] = ties
    x.view(-1)[-4:] = torch.tensor([1e6, -1e6, 255 * SCALE, -ZP * SCALE])
    return x


ROWS = {"avx512bw", "avx512vl"} <= set(detect().cpu.features)  # the hand-written loop runs here


@pytest.mark.parametrize("channels", [1, 2, 3, 4, 5])
def test_the_input_quantizes_as_the_pt2e_graph_does(channels):
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

    x = inputs(channels)
    codes = torch.ops.quantized_decomposed.quantize_per_tensor(x, SCALE, ZP, 0, 255, torch.uint8)
    want = (codes.float() - ZP) * SCALE
    got = through(x, "int8")
    if ROWS and channels <= 4:
        assert torch.equal(got, want)
    else:  # oneDNN's reorder: at most one code off, and only on a tie
        steps = ((got - want) / SCALE).round()
        assert steps.abs().max() <= 1
        off = x[steps != 0] / SCALE
        assert torch.allclose(off - off.floor(), torch.full_like(off, 0.5), atol=1e-4)


@pytest.mark.parametrize("channels", [1, 3, 5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float_input_is_converted_exactly(channels, dtype):
    x = inputs(channels)
    want = x if dtype == "float32" else x.bfloat16().float()
    assert torch.equal(through(x, dtype), want)


def test_a_torch_op_library_loaded_first_leaves_the_runner_working():
    """Load order, in a fresh process: a torch op library that links pip's oneDNN and libtorch_cpu
    (cpu_attention) first, then several nets. On torch 2.6, pip's libdnnl loaded as that library's
    dependency bound its weak C++ symbols to the copies libtorch_cpu exports from torch's own oneDNN,
    and every net after the first failed to build ("could not create a primitive") or corrupted the
    heap; kernels/onednn_net.py now loads libdnnl on its own first."""
    from torchkiln.kernels import cpu_attention

    if cpu_attention.load() is not None:
        pytest.skip(f"no attention op: {cpu_attention.load()}")
    code = textwrap.dedent("""
        import torch
        from torchkiln.kernels import cpu_attention, onednn_net as k
        from torchkiln.kernels.onednn_net import Net, Program
        assert cpu_attention.load() is None
        for c in (1, 3, 5):
            for dtype in ("float32", "bfloat16"):
                x = torch.randn(2, c, 7, 37)
                y = Net(k.load(), Program(steps=[], out=0, dtype=dtype, winograd=0), tuple(x.shape))(x)
                assert torch.equal(y, x if dtype == "float32" else x.bfloat16().float()), (c, dtype)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
