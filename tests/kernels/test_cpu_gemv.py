"""torchkiln::cpu_gemv (kernels/cpu_gemv.cpp) against float64 products, inside torch.compile, its
error messages, and how it is built (and not built)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.profiler import profile

from torchkiln.kernels import cpu_gemv

here = pytest.mark.skipif(cpu_gemv._why_not_here() is not None, reason=f"{cpu_gemv._why_not_here()}")


@pytest.fixture(scope="module")
def op():
    why = cpu_gemv.load()
    assert why is None, why  # on an x86 CPU with AVX2 and a compiler (CI), it must build
    return cpu_gemv.gemv


def operands(n, k, wdtype, xdtype, lead=(1,), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(xdtype)
    if wdtype == torch.int8:
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = (torch.rand(n, generator=g) / 100).to(xdtype)
    else:
        w, s = torch.randn(n, k, generator=g).to(wdtype), None
    return x, w, s


def reference(x, w, s):
    """The same (already rounded) values multiplied in float64."""
    y = x.double() @ w.double().t()
    return y * s.double() if s is not None else y


@here
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,lead", [(13, 37, (1,)), (64, 1024, (1, 1)), (1000, 300, (1,)), (24, 40, (3,))])
def test_matches_a_float64_product(op, wdtype, xdtype, n, k, lead):
    """Odd widths (the scalar tail), odd row counts (the last block), leading dims, several rows of x.
    The output is in x's dtype: float32 within accumulation error, bf16 within its rounding (2^-8).
    int8 weights: x is rounded to int16 per 256-value chunk first (cpu_gemv.cpp), half a step of
    1/32767 of the chunk's largest |x| per value, so float32 outputs hold to 2e-4 (measured ~3e-5)."""
    x, w, s = operands(n, k, wdtype, xdtype, lead)
    y = op(x, w, s)
    ref = reference(x, w, s)
    assert y.dtype == xdtype and y.shape == (*lead, n)
    tol = 1e-5 if wdtype != torch.int8 else 2e-4
    rtol = tol if xdtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=tol * ref.abs().max().item())


@here
def test_int8_rounds_x_per_chunk_within_its_bound(op):
    """The int8 path's only extra error is x's int16 rounding per 256-value chunk: with an outlier
    1000x the rest in one chunk, each output stays within half a step (chunk max / 32767 / 2) times
    the sum of |w| over that chunk's columns, against a float64 product of the unrounded x; rows
    with inf or NaN are summed in float and give inf / NaN where F.linear does."""
    g = torch.Generator().manual_seed(3)
    n, k = 64, 600  # chunks of 256, 256 and 88
    x = torch.randn(1, k, generator=g)
    x[0, 300] = 1000.0
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.ones(n)
    got = op(x, w, s).double()
    ref = x.double() @ w.double().t()
    bound = sum(x[0, c:c + 256].abs().max().item() / 32767 / 2 * w[:, c:c + 256].double().abs().sum(1)
                for c in range(0, k, 256))
    assert bool(((got - ref).abs() <= bound + 1e-6 * ref.abs()).all())
    assert float((got - ref).abs().max()) > 0  # it does round: this is not the float path
    bad = torch.randn(2, k, generator=g)
    bad[1, 7] = float("inf")
    want = torch.nn.functional.linear(bad, w.float())
    out = op(bad, w, s)
    assert torch.equal(out[1].isnan(), want[1].isnan()) and torch.equal(out[1].isinf(), want[1].isinf())
    torch.testing.assert_close(out[0], want[0], rtol=2e-4, atol=2e-4 * want[0].abs().max().item())


@here
def test_compiled_calls_the_op_and_gives_the_same_values(op):
    x, w, s = operands(40, 96, torch.int8, torch.bfloat16)
    compiled = torch.compile(lambda x, w, s: op(x, w, s) * 2, fullgraph=True)
    with profile() as prof:
        got = compiled(x, w, s)
    assert "torchkiln::cpu_gemv" in {e.key for e in prof.key_averages()}
    assert torch.equal(got, op(x, w, s) * 2)


@here
@pytest.mark.parametrize("args,message", [
    (lambda: (torch.randn(1, 8), torch.randn(8, 4).t(), None), "contiguous 2-D"),
    (lambda: (torch.randn(1, 5), torch.randn(3, 4), None), "last dim must be 4"),
    (lambda: (torch.randn(1, 4).half(), torch.randn(3, 4), None), "float32 or bfloat16"),
    (lambda: (torch.randn(1, 4), torch.randn(3, 4).double(), None), "float32, bfloat16 or int8"),
    (lambda: (torch.randn(1, 4), torch.ones(3, 4, dtype=torch.int8), None), "int8 weights need scale"),
    (lambda: (torch.randn(1, 4), torch.ones(3, 4, dtype=torch.int8), torch.ones(2)), "scale must hold 3"),
])
def test_bad_operands_name_what_is_wrong(op, args, message):
    with pytest.raises(ValueError, match=message):
        op(*args())


@here
def test_the_ops_own_checks_raise_catchable_errors(op):
    """The op's TORCH_CHECK backstops, called directly (no Python check first). In a child process: on
    the H200 image a message with a number in it segfaulted (fifteenth session; cpu_gemv.cpp says
    why), and a crash here must be this test's failure, not the end of the run."""
    code = ("import torch; from torchkiln.kernels import cpu_gemv; assert cpu_gemv.load() is None\n"
            "cases = [(torch.randn(1, 8), torch.randn(8, 4).t(), None),\n"
            "         (torch.randn(1, 5), torch.randn(3, 4), None),\n"
            "         (torch.randn(1, 4).half(), torch.randn(3, 4), None),\n"
            "         (torch.randn(1, 4), torch.randn(3, 4).double(), None),\n"
            "         (torch.randn(1, 4), torch.ones(3, 4, dtype=torch.int8), torch.ones(2))]\n"
            "for x, w, s in cases:\n"
            "    try:\n        torch.ops.torchkiln.cpu_gemv(x, w, s)\n"
            "    except RuntimeError as e:\n        print('raised:', str(e).splitlines()[0])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "raised: torchkiln::cpu_gemv: weight must be a contiguous 2-D tensor, got sizes [4, 8] strides [1, 4]",
        "raised: torchkiln::cpu_gemv: x's last dim must be 4 (the weight's in_features), got sizes [1, 5]",
        "raised: torchkiln::cpu_gemv: x must be float32 or bfloat16, got Half",
        "raised: torchkiln::cpu_gemv: weight must be float32, bfloat16 or int8, got Double",
        "raised: torchkiln::cpu_gemv: scale must hold 3 values, got 2"]


def test_fits_only_what_the_op_takes():
    w = torch.randn(8, 4)
    assert cpu_gemv.fits(torch.float32, w) and cpu_gemv.fits(torch.bfloat16, w.bfloat16())
    assert not cpu_gemv.fits(torch.float16, w)
    assert not cpu_gemv.fits(torch.float32, w.t())
    assert not cpu_gemv.fits(torch.float32, w.double())


def test_no_compiler_or_another_isa_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_compiler", lambda: None)
    monkeypatch.setattr(cpu_gemv.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_gemv.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert "no C++ compiler" in cpu_gemv.load.__wrapped__()
    monkeypatch.setattr(cpu_gemv.platform, "machine", lambda: "aarch64")
    assert "x86-64 only" in cpu_gemv.load.__wrapped__()
    monkeypatch.setattr(cpu_gemv.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_gemv.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert "needs AVX2" in cpu_gemv.load.__wrapped__()


@here
@here
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_strided_x_and_any_float_scale(op, sdtype):
    """x and the scales read through strided views, scales of any float dtype (float16 goes through
    a copy, float32 and bfloat16 are read in place), give the float64 product of the same values."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(3, 2 * 320, generator=g).to(torch.bfloat16)
    x = wide[:, ::2]
    assert not x.is_contiguous()
    w = torch.randint(-127, 128, (48, 320), generator=g, dtype=torch.int8)
    s = (torch.rand(96, generator=g) / 100).to(sdtype)[::2]
    assert not s.is_contiguous()
    got = op(x, w, s)
    ref = reference(x, w, s)
    torch.testing.assert_close(got.double(), ref, rtol=2 ** -8, atol=2e-4 * ref.abs().max().item())
