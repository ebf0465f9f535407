"""torchkiln::qlinear_u8 (kernels/cpu_qlinear.cpp) against float math on the same int8 codes and
pt2e's own quantize op, its weight cache, inside torch.compile, and its errors."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from torchkiln.kernels import cpu_qlinear

pytestmark = pytest.mark.skipif(cpu_qlinear.load() is not None, reason=f"{cpu_qlinear.load()}")


def operands(m=24, k=64, n=48, lead=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (*lead, m, k), generator=g, dtype=torch.uint8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, generator=g) * 0.004 + 1e-3
    return x, w, ws, torch.randn(n, generator=g)


def reference(x, sx, zx, w, ws, b):
    """pt2e's dequantize -> linear, in float64 on the same codes."""
    y = (x.double() - zx) * sx @ (w.double() * ws.double()[:, None]).t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("lead", [(), (2,)], ids=["2-D", "3-D"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_float_out_matches_the_dequantized_linear(lead, with_bias):
    x, w, ws, b = operands(lead=lead)
    b = b if with_bias else None
    out = cpu_qlinear.qlinear(x, 0.05, 131, w, ws, b)
    ref = reference(x, 0.05, 131, w, ws, b)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # int32 accumulation is exact; only the float32 scaling rounds (a wrong zero point or scale: > 1%)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("post, approximate", [("gelu_erf", "none"), ("gelu_tanh", "tanh")])
def test_gelu_and_a_uint8_quantize_match_pt2es_ops(post, approximate):
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers quantized_decomposed

    x, w, ws, b = operands(m=64, k=128, n=96)
    y = F.gelu(reference(x, 0.05, 131, w, ws, b).float(), approximate=approximate)
    so, zo = float(y.max()) / 220, 17  # as a calibrated observer would: most of the range in 255 codes
    out = cpu_qlinear.qlinear(x, 0.05, 131, w, ws, b, post, so, zo)
    ref = torch.ops.quantized_decomposed.quantize_per_tensor(y, so, zo, 0, 255, torch.uint8)
    assert out.dtype == torch.uint8
    d = (out.int() - ref.int()).abs()
    # a value within float32 rounding of a step boundary may land one code off; a wrong scale, zero
    # point or GELU moves most codes
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) < 1e-3
    assert 0 < int(ref.min()) <= zo < int(ref.max()) < 255  # GELU's negative lobe below zo, nothing saturated


def test_the_cache_lets_go_of_a_freed_weight():
    x, w, ws, b = operands()
    before = torch.ops.torchkiln.qlinear_u8_entries()
    a = cpu_qlinear.qlinear(x, 0.05, 131, w, ws, b)
    assert torch.ops.torchkiln.qlinear_u8_entries() == before + 1
    assert torch.equal(cpu_qlinear.qlinear(x[:5], 0.05, 131, w, ws, b), a[:5])  # another row count: a plan of its own
    w2 = w.clone()  # the same values at another address: another entry, the same result
    assert torch.equal(cpu_qlinear.qlinear(x, 0.05, 131, w2, ws, b), a)
    del w, w2
    gc.collect()
    assert torch.ops.torchkiln.qlinear_u8_entries() == before


def test_under_compile():
    x, w, ws, b = operands(lead=(2,))

    def f(x):
        return cpu_qlinear.qlinear(x, 0.05, 131, w, ws, b, "gelu_erf", 0.02, 17).float() + 1

    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))


@pytest.mark.parametrize("bad, message", [
    (dict(x=lambda x: x.float()), "x must be uint8"),
    (dict(x=lambda x: x[:, :10]), "x's last dim must be 64"),
    (dict(w=lambda w: w.t()), "w must be a contiguous 2-D int8 tensor"),
    (dict(ws=lambda s: s[:5]), "w_scale must hold 48"),
    (dict(post="relu"), "post must be 'none', 'gelu_erf' or 'gelu_tanh'"),
    (dict(w_zp=torch.ones(48, dtype=torch.long)), "must be symmetric"),
])
def test_bad_operands_are_named(bad, message):
    x, w, ws, b = operands(seed=3)
    x, w, ws = (bad.get(n, lambda t: t)(t) for n, t in (("x", x), ("w", w), ("ws", ws)))
    with pytest.raises(RuntimeError, match=message):
        cpu_qlinear.qlinear(x, 0.05, 131, w, ws, b, bad.get("post", "none"), w_zp=bad.get("w_zp"))
