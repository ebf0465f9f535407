import pytest
import torch
import torch.nn.functional as F

from torchkiln.passes.sdpa_math import SDPARouter, sdpa_math


def qkv(dtype=torch.float32, heads=4, kv_heads=4, L=16, S=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, L, 8, generator=g).to(dtype), torch.randn(2, kv_heads, S, 8, generator=g).to(dtype),
            torch.randn(2, kv_heads, S, 8, generator=g).to(dtype))


@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "all_true_mask", "scale", "gqa", "L!=S"])
def test_matches_sdpa(case):
    q, k, v = qkv(kv_heads=2 if case == "gqa" else 4, S=24 if case == "L!=S" else 16)
    kw = {}
    if case == "causal" or case == "L!=S":
        kw["is_causal"] = True
    if case == "bool_mask":
        kw["attn_mask"] = torch.rand(2, 1, 16, 16) > 0.3
        kw["attn_mask"][..., 0] = True  # no fully masked row
    if case == "float_mask":
        kw["attn_mask"] = torch.randn(2, 1, 16, 16)
    if case == "all_true_mask":
        kw["attn_mask"] = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    if case == "scale":
        kw["scale"] = 0.3
    if case == "gqa":
        kw["enable_gqa"] = True
    ref_kw = dict(kw)
    if case == "float_mask":
        ref_kw["attn_mask"] = kw["attn_mask"].double()
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **ref_kw)
    got = sdpa_math(q, k, v, kw.get("attn_mask"), kw.get("is_causal", False), kw.get("scale"), kw.get("enable_gqa", False))
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_router_routes_only_measured_winners():
    q, k, v = qkv()
    r = SDPARouter()
    r.calibrating = True
    with r:
        out = F.scaled_dot_product_attention(q, k, v)
    assert len(r.timings) == 1 and len(r.choices) == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-5)
    key = next(iter(r.choices))
    r.calibrating = False
    for forced in (True, False):
        r.choices[key] = forced
        with torch.profiler.profile() as prof, r:
            F.scaled_dot_product_attention(q, k, v)
        names = {e.key for e in prof.key_averages()}
        assert ("torchkiln::sdpa_math" in names) == forced
    # An uncalibrated shape keeps SDPA even when routing is on.
    q2, k2, v2 = qkv(L=32, S=32)
    with torch.profiler.profile() as prof, r:
        F.scaled_dot_product_attention(q2, k2, v2)
    assert "torchkiln::sdpa_math" not in {e.key for e in prof.key_averages()}


def test_dropout_is_never_rerouted():
    q, k, v = qkv()
    r = SDPARouter()
    r.calibrating = True
    with r:
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert r.choices == {}


def test_traced_by_compile():
    q, k, v = qkv(torch.bfloat16)
    r = SDPARouter()
    r.calibrating = True
    with r:
        F.scaled_dot_product_attention(q, k, v)
    r.calibrating = False
    r.choices = dict.fromkeys(r.choices, True)

    def f(q, k, v):
        with r:
            return F.scaled_dot_product_attention(q, k, v) * 2

    out = torch.compile(f, fullgraph=True)(q, k, v)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double()) * 2
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
