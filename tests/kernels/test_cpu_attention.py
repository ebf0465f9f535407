"""torchkiln::attention_bf16 (kernels/cpu_attention.cpp) against attention computed in float64 on
the same bf16 values, for the layouts and masks the int8 transformer path hands it; inside
torch.compile; its fake's strides; its errors; and a missing oneDNN named."""

from __future__ import annotations

import pytest
import torch

from torchkiln.kernels import cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.load() is not None, reason=f"{cpu_attention.load()}")


def reference(q, k, v, bias, scale):
    s = q.double() @ k.double().transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    return torch.softmax(s, -1) @ v.double()


def packed_qkv(b=2, n=32, h=4, d=16, s=None, seed=0):
    """q, k, v as per-head views of one projection's output [B, L, 3, H, D] (strided, as a merged
    Q/K/V linear gives them), or k and v of another length ``s`` (cross attention)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, n, 3, h, d, generator=g).bfloat16()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    if s is not None:
        kv = torch.randn(b, s, 2, h, d, generator=g).bfloat16()
        k, v = (kv[:, :, i].transpose(1, 2) for i in range(2))
    return q, k, v


def masks(b, h, n, s):
    g = torch.Generator().manual_seed(1)
    pad = torch.zeros(b, 1, 1, s)
    pad[0, ..., s // 2:] = float("-inf")  # a padded batch row: half the keys masked
    return {"none": None, "padding [B,1,1,S]": pad, "padding bf16": pad.bfloat16(),
            "rows [B,1,L,S]": torch.randn(b, 1, n, s, generator=g),
            "shared [1,1,L,S]": torch.randn(1, 1, n, s, generator=g),
            "per head [B,H,L,S]": torch.randn(b, h, n, s, generator=g)}


@pytest.mark.parametrize("case", list(masks(2, 4, 32, 32)))
@pytest.mark.parametrize("s", [None, 48], ids=["self", "cross"])
def test_matches_float64_attention(case, s):
    q, k, v = packed_qkv(s=s)
    bias = masks(2, 4, 32, k.size(2))[case]
    out = cpu_attention.attention(q, k, v, bias, 0.25)
    ref = reference(q, k, v, bias, 0.25)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    # bf16 scores and probabilities: ~0.4% rounding each; a wrong scale, bias or layout is off by
    # more (the same check with scale 0.3 for 0.25: 15-20%)
    assert float((out.double() - ref).norm() / ref.norm()) < 0.01
    # the output is laid out as [B, L, H, D], so the head merge after it is a view
    assert out.transpose(1, 2).is_contiguous()


def test_contiguous_operands_and_repeated_calls_match():
    q, k, v = (t.contiguous() for t in packed_qkv(b=1, n=64, h=2, d=32))
    first = cpu_attention.attention(q, k, v, None, 0.125)
    again = cpu_attention.attention(q, k, v, None, 0.125)  # the cached plan
    other = cpu_attention.attention(q, k, v, None, 0.5)  # a scale is part of the plan's key
    assert torch.equal(first, again)
    for out, scale in ((first, 0.125), (other, 0.5)):
        ref = reference(q, k, v, None, scale)
        assert float((out.double() - ref).norm() / ref.norm()) < 0.01


def test_under_compile_and_the_fake_has_the_real_strides():
    q, k, v = packed_qkv()
    bias = masks(2, 4, 32, 32)["padding [B,1,1,S]"]

    def f(q, k, v, bias):
        return cpu_attention.attention(q, k, v, bias, 0.25).transpose(1, 2).reshape(2, 32, 64)

    got = torch.compile(f, fullgraph=True)(q, k, v, bias)
    assert torch.equal(got, f(q, k, v, bias))
    fake = cpu_attention._fake(q, k, v, bias, 0.25)
    real = cpu_attention.attention(q, k, v, bias, 0.25)
    assert fake.shape == real.shape and fake.stride() == real.stride()


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v: (q.float(), k, v), "must be bfloat16"),
    (lambda q, k, v: (q[0], k, v), "q must have 4 dims"),
    (lambda q, k, v: (q, k[:, :2], v), "must be [B, H, L, D]"),
    (lambda q, k, v: (q, k, v.transpose(2, 3)), "unit last stride"),
])
def test_bad_operands_are_named(bad, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cpu_attention.attention(*bad(*packed_qkv()), None, 0.25)


def test_a_missing_onednn_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHKILN_ONEDNN_ROOT", str(tmp_path))
    why = cpu_attention.load.__wrapped__()
    assert isinstance(why, str) and str(tmp_path) in why and 'pip install "torchkiln[onednn]"' in why
