import contextlib

import pytest
import torch
import torch.nn.functional as F

from torchkiln.passes.sdpa_math import SDPARouter, attention, sdpa, sdpa_math, sdpa_math_bf16

OPS = {"sdpa_math": sdpa_math, "sdpa": sdpa}


def qkv(dtype=torch.float32, heads=4, kv_heads=4, L=16, S=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, L, 8, generator=g).to(dtype), torch.randn(2, kv_heads, S, 8, generator=g).to(dtype),
            torch.randn(2, kv_heads, S, 8, generator=g).to(dtype))


def ref_sdpa(q, k, v, **kw):
    """F.scaled_dot_product_attention in float64 (a float mask too)."""
    m = kw.get("attn_mask")
    if m is not None and m.is_floating_point():
        kw = {**kw, "attn_mask": m.double()}
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


def call(op, q, k, v, **kw):
    return op(q, k, v, kw.get("attn_mask"), kw.get("is_causal", False), kw.get("scale"), kw.get("enable_gqa", False))


def profiled(fn):
    with torch.profiler.profile() as prof:
        out = fn()
    return out, {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "all_true_mask", "scale", "gqa", "L!=S"])
def test_matches_sdpa(op, case):
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
    torch.testing.assert_close(call(OPS[op], q, k, v, **kw).double(), ref_sdpa(q, k, v, **kw), rtol=1e-5, atol=1e-5)


def left_padded_mask(L=16, pads=(0, 5)):
    """A decoder's mask as transformers builds it: causal AND not-padding, padding on the left."""
    keep_key = torch.stack([torch.arange(L) >= p for p in pads])  # (B, S)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return causal & keep_key[:, None, None, :], keep_key


def fully_masked_cases():
    bool_mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    bool_mask[1, 0, 3] = False
    float_mask = torch.randn(2, 1, 16, 16)
    float_mask[0, 0, 7] = float("-inf")
    causal_pad, _ = left_padded_mask()
    return {"bool_row": ({"attn_mask": bool_mask}, [(1, 3)]),
            "float_row": ({"attn_mask": float_mask}, [(0, 7)]),
            "left_padded": ({"attn_mask": causal_pad}, [(1, i) for i in range(5)])}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", ["bool_row", "float_row", "left_padded"])
def test_fully_masked_rows_give_zeros(op, case):
    kw, dead = fully_masked_cases()[case]
    q, k, v = qkv()
    ref = ref_sdpa(q, k, v, **kw)
    # torch >= 2.5's safe softmax: a query row with every key masked is 0, not NaN.
    for b, i in dead:
        assert (ref[b, :, i] == 0).all()
    got = call(OPS[op], q, k, v, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_padding_mask_with_is_causal():
    # is_causal plus a padding-only mask must empty the same rows as the combined
    # mask (sdpa_math only: F.sdpa on older torch rejects a mask with is_causal).
    combined, keep_key = left_padded_mask()
    q, k, v = qkv()
    got = sdpa_math(q, k, v, keep_key[:, None, None, :], True, None, False)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), ref_sdpa(q, k, v, attn_mask=combined), rtol=1e-5, atol=1e-5)


def key_constant_masks():
    """Masks constant along the keys, as transformers 5.17 builds when traced with
    attention_mask=None: expanded (last stride 0) or of key size 1. Row 5 of batch 1
    sees no key."""
    rows = torch.ones(2, 1, 16, 1, dtype=torch.bool)
    rows[1, 0, 5] = False
    add = torch.randn(2, 1, 16, 1).masked_fill(~rows, float("-inf"))
    return {"bool_expanded": rows.expand(2, 1, 16, 16), "bool_key_size_1": rows,
            "float_expanded": add.expand(2, 1, 16, 16), "float_key_size_1": add}


@pytest.mark.parametrize("case", list(key_constant_masks()))
def test_key_constant_mask_matches_sdpa(case):
    mask = key_constant_masks()[case]
    assert mask.size(-1) == 1 or mask.stride(-1) == 0
    q, k, v = qkv()
    # Reference: SDPA in float64 on a materialised copy of the mask.
    ref = ref_sdpa(q, k, v, attn_mask=mask.expand(2, 1, 16, 16).contiguous())
    assert (ref[1, :, 5] == 0).all()
    got = attention(q, k, v, mask, False, None, False)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # With is_causal too (the reference gets causal and the mask as one mask).
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    full = mask.expand(2, 1, 16, 16)
    both = full & causal if mask.dtype == torch.bool else full.masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(attention(q, k, v, mask, True, None, False).double(),
                               ref_sdpa(q, k, v, attn_mask=both), rtol=1e-5, atol=1e-5)


def test_key_constant_mask_drops_mask_kernel_work():
    # The op runs SDPA without the mask: the profile shows no mask-applying math path.
    q, k, v = qkv()
    mask = key_constant_masks()["bool_expanded"]
    _, names = profiled(lambda: attention(q, k, v, mask, False, None, False))
    assert "aten::_scaled_dot_product_attention_math" not in names


@pytest.mark.parametrize("op", OPS)
def test_fake_matches_real(op):
    # Inductor asserts an extern op's real strides against the fake's; SDPA's
    # output follows q's layout, which is transposed in most models.
    q = torch.randn(2, 16, 4, 8).transpose(1, 2)
    kv = q[:, :2].contiguous()
    mask = torch.rand(2, 1, 16, 16) > 0.5
    expanded = key_constant_masks()["bool_expanded"]
    for args in [(q, q, q, None, True, None, False), (q, q, q, mask, False, 0.3, False),
                 (q, kv, kv, None, False, None, True), (q, q, q, expanded, False, None, False)]:
        torch.library.opcheck(OPS[op], args)


def test_router_auto_routes_measured_choices():
    q, k, v = qkv()
    r = SDPARouter()
    r.calibrating = True
    with r:
        out = F.scaled_dot_product_attention(q, k, v)
    assert len(r.timings) == 1 and len(r.choices) == 1
    torch.testing.assert_close(out.double(), ref_sdpa(q, k, v), rtol=1e-5, atol=1e-5)
    key = next(iter(r.choices))
    r.calibrating = False
    for use_math, ran in ((True, "torchkiln::sdpa_math"), (False, "torchkiln::sdpa")):
        r.choices[key] = "math" if use_math else "sdpa"
        with r:
            out, names = profiled(lambda: F.scaled_dot_product_attention(q, k, v))
        assert ran in names and {"torchkiln::sdpa_math", "torchkiln::sdpa"} - {ran} - names
        torch.testing.assert_close(out.double(), ref_sdpa(q, k, v), rtol=1e-5, atol=1e-5)
        assert f"auto: math attention for {int(use_math)}/1 shapes" in r.summary()
    # An uncalibrated shape keeps plain SDPA.
    q2, k2, v2 = qkv(L=32, S=32)
    with r:
        _, names = profiled(lambda: F.scaled_dot_product_attention(q2, k2, v2))
    assert not {"torchkiln::sdpa_math", "torchkiln::sdpa"} & names


def test_router_opaque_routes_everything_unmeasured():
    q, k, v = qkv(kv_heads=2)
    mask = torch.rand(2, 1, 16, 16) > 0.3
    r = SDPARouter(mode="opaque")
    r.calibrating = True
    with r:
        out, names = profiled(lambda: F.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True))
    assert "torchkiln::sdpa" in names and "torchkiln::sdpa_math" not in names
    assert r.timings == {} and r.choices == {}
    assert r.summary().startswith("opaque")
    torch.testing.assert_close(out.double(), ref_sdpa(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["plain", "bool_mask_dead_row", "float_mask", "causal", "gqa"])
def test_low_math_attention_matches_sdpa_within_bf16(case):
    """The bf16 math form (int8 models' attention on native-bf16 CPUs) against float64 SDPA:
    bf16's rounding (2^-8 relative), not worse, and SDPA's zeros for a row that sees no key."""
    q, k, v = qkv(kv_heads=2 if case == "gqa" else 4)
    kw = {"is_causal": case == "causal", "enable_gqa": case == "gqa"}
    if case == "bool_mask_dead_row":
        kw["attn_mask"], _ = left_padded_mask()
    if case == "float_mask":
        kw["attn_mask"] = torch.randn(2, 1, 16, 16)
    out = call(sdpa_math_bf16, q, k, v, **kw)
    assert out.dtype == torch.float32
    ref = ref_sdpa(q, k, v, **kw)
    if case == "bool_mask_dead_row":
        ref = ref.nan_to_num(0.0)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
    # and it is bf16, not float32: the error is above float32's
    assert (out.double() - ref).abs().max() > 1e-4


def test_router_auto_bf16_times_the_bf16_form_and_routes_it():
    q, k, v = qkv(L=64, S=64)
    mask = torch.rand(2, 1, 64, 64) > 0.2
    mask[..., 0] = True
    r = SDPARouter(mode="auto-bf16")
    r.calibrating = True
    with r:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    r.calibrating = False
    key = next(iter(r.timings))
    assert set(r.timings[key]) == {"sdpa", "math-bf16"}
    assert r.choices[key] == min(r.timings[key], key=r.timings[key].get)
    ref = ref_sdpa(q, k, v, attn_mask=mask)
    r.choices[key] = "math-bf16"
    with r:
        out, names = profiled(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert "torchkiln::sdpa_math_bf16" in names and "torchkiln::sdpa" not in names
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
    # compiled: inline, in bf16, no SDPA kernel: its GEMMs with only the softmax opaque, or, where the C++ op
    # builds (kernels/cpu_attention.py), the whole attention as that one op
    # compiled afresh (torch 2.6 reused an earlier test's compiled SDPA here) and before the profiled
    # call (torch 2.6 profiles tracing's own aten::bmm inside the first call)
    torch._dynamo.reset()
    compiled = torch.compile(F.scaled_dot_product_attention, fullgraph=True)
    with r:
        compiled(q, k, v, attn_mask=mask)
        out, names = profiled(lambda: compiled(q, k, v, attn_mask=mask))
    opaque = {n for n in names if "scaled_dot_product" in n or "torchkiln::" in n}
    if r.fused:
        assert opaque == {"torchkiln::attention_bf16"} and "aten::bmm" not in names
    else:
        assert "aten::bmm" in names and not opaque - {"torchkiln::softmax_lastdim"}
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
    # bf16 inputs are timed as in "auto": the bf16 form is for float32 inputs only
    r.calibrating = True
    with r:
        F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert set(r.timings[max(r.timings, key=lambda t: t[1] == "torch.bfloat16")]) == {"sdpa", "math"}


def test_router_rejects_unknown_mode():
    with pytest.raises(ValueError):
        SDPARouter(mode="fast")


@pytest.mark.parametrize("mode", ["auto", "opaque"])
def test_dropout_and_grad_are_never_rerouted(mode):
    q, k, v = qkv()
    r = SDPARouter(mode)
    r.calibrating = True
    with r:
        _, names = profiled(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
        q.requires_grad_()
        _, names_grad = profiled(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    assert r.choices == {}
    assert not any(n.startswith("torchkiln::") for n in names | names_grad)
    assert q.grad is not None


def test_autocast_dtype_kept_when_compiled():
    # Compiled, autocast cannot reach into the opaque op: the router casts for it.
    q, k, v = qkv()

    def f(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(q, k, v)

    eager = f(q, k, v)
    with SDPARouter(mode="opaque"):
        out = torch.compile(f, fullgraph=True)(q, k, v)
    assert out.dtype == eager.dtype == torch.bfloat16


@pytest.mark.parametrize("use_math", [True, False, None])
def test_traced_by_compile(use_math):
    """fullgraph through the mode, whether entered inside the compiled function
    or around it (as the runner does), with a traced mask."""
    q, k, v = qkv()
    mask, _ = left_padded_mask()
    r = SDPARouter() if use_math is not None else SDPARouter(mode="opaque")
    if use_math is not None:
        r.calibrating = True
        with r:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        r.calibrating = False
        r.choices = dict.fromkeys(r.choices, "math" if use_math else "sdpa")
    # Compiled, the math form runs inline (math_attention): its GEMMs, no SDPA kernel. SDPA chosen on the
    # CPU runs inline too (inductor keeps the flash kernel); only opaque mode keeps the wall.
    ran = {True: "aten::bmm", False: "aten::_scaled_dot_product_flash_attention_for_cpu", None: "torchkiln::sdpa"}[use_math]
    ref = ref_sdpa(q, k, v, attn_mask=mask) * 2

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2

    def f_inside(q, k, v, mask):
        with r:
            return f(q, k, v, mask)

    for compiled, outer in ((torch.compile(f_inside, fullgraph=True), None),
                            (torch.compile(f, fullgraph=True), r)):
        with outer or contextlib.nullcontext():
            out, names = profiled(lambda compiled=compiled: compiled(q, k, v, mask))
        assert ran in names
        if use_math:
            assert not {n for n in names if "scaled_dot_product" in n or n.startswith("torchkiln::")}, names
        elif use_math is False:
            assert not {n for n in names if n.startswith("torchkiln::")}, names
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_hf_bert_opaque_under_compile():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, attn_implementation="sdpa")
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        compiled = torch.compile(model, fullgraph=False)
        with SDPARouter(mode="opaque"):
            compiled(input_ids=ids, attention_mask=mask)
            out, names = profiled(lambda: compiled(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert "torchkiln::sdpa" in names
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-6)


def test_key_constant_mask_under_compile():
    # The stride-0 mask is seen while tracing: the op gets no mask, rows are zeroed in-graph.
    mask = key_constant_masks()["bool_expanded"]
    q, k, v = qkv()

    def f(q, k, v, rows):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=rows.expand(2, 1, 16, 16))

    with SDPARouter(mode="opaque"):
        out, names = profiled(lambda: torch.compile(f, fullgraph=True)(q, k, v, mask[..., :1]))
    assert "torchkiln::sdpa" in names
    torch.testing.assert_close(out.double(), ref_sdpa(q, k, v, attn_mask=mask.contiguous()), rtol=1e-5, atol=1e-5)


def key_padding_masks(batch=3, L=16, S=16):
    """Boolean key-padding masks as transformers builds them from a 2-D attention_mask:
    one row per batch broadcast over the queries. Batch 1 has padded keys; batch 2 has none
    left (every query row sees no key)."""
    keep = torch.ones(batch, S, dtype=torch.bool)
    keep[1, -5:] = False
    keep[2] = False
    rows = keep[:, None, None, :]
    return {"expanded": rows.expand(batch, 1, L, S), "query_size_1": rows}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(key_padding_masks()))
def test_key_padding_mask_on_cuda(dtype, case):
    # CUDA's fused kernels leave rows that see no key undefined; attention() must give SDPA's
    # zeros there, eager and compiled, with the rest of the result unchanged.
    mask = key_padding_masks()[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 16, 64, generator=g) for _ in range(3))
    ref = ref_sdpa(q, k, v, attn_mask=mask.expand(3, 1, 16, 16).contiguous())
    assert (ref[2] == 0).all()
    dev = [t.cuda().to(dtype) for t in (q, k, v)]
    got = attention(*dev, mask.cuda(), False, None, False)
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double().cpu(), ref, rtol=tol, atol=tol)
    compiled = torch.compile(lambda *a: attention(*a), fullgraph=True)
    torch.testing.assert_close(compiled(*dev, mask.cuda(), False, None, False).double().cpu(), ref,
                               rtol=tol, atol=tol)


class _Attend(torch.nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x)


@pytest.mark.parametrize("attends", [False, True])
def test_runner_keeps_the_router_only_for_models_that_attend(attends):
    # an eager candidate runs every op under the router's mode; without attention that is pure cost
    from torchkiln.recipe import Recipe
    from torchkiln.runner import Runner

    model = _Attend() if attends else torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(1, 2, 16, 8)
    runner = Runner(model, Recipe(attention="auto"))
    runner.calibrate((x,), {})
    assert (runner.router is not None) == attends
    if attends:
        assert runner.router.seen == 1
    torch.testing.assert_close(runner(x), model(x), rtol=1e-5, atol=1e-6)  # the same answer either way


@pytest.mark.parametrize("case", ["bool_mask_dead_row", "float_mask", "mask_b1", "mask_b1_rows", "causal", "none"])
def test_opaque_softmax_form_matches_sdpa_under_compile(case):
    """The int8 models' compiled attention (math-bf16 with softmax as torchkiln::softmax_lastdim, and a
    batch-broadcast mask folded into baddbmm) against float64 SDPA: within bf16's rounding, SDPA's zeros
    for a row that sees no key, and the opaque softmax really called (the form is not the fused one)."""
    from torchkiln.passes.sdpa_math import low_math_attention

    q, k, v = qkv()
    kw = {"is_causal": case == "causal"}
    if case == "bool_mask_dead_row":
        kw["attn_mask"], _ = left_padded_mask()  # batch 2: the mask is added, not folded
    if case == "float_mask":
        kw["attn_mask"] = torch.randn(2, 1, 16, 16)
    if case in ("mask_b1", "mask_b1_rows"):  # one mask for every batch and head: folded into baddbmm
        m = torch.rand(1, 1, 1 if case == "mask_b1" else 16, 16) > 0.3
        m[..., 0] = True
        if case == "mask_b1_rows":
            m[0, 0, 4] = False  # a row that sees no key
        kw["attn_mask"] = m

    def f(q, k, v, m):
        return low_math_attention(q, k, v, m, kw["is_causal"], None, False, opaque_softmax=True)

    out, names = profiled(lambda: torch.compile(f, fullgraph=True)(q, k, v, kw.get("attn_mask")))
    assert "torchkiln::softmax_lastdim" in names
    if case.startswith("mask_b1"):
        assert "aten::baddbmm" in names
    ref = ref_sdpa(q, k, v, **kw).nan_to_num(0.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)


@pytest.mark.parametrize("case", ["bool_mask_dead_row", "float_mask", "mask_b1_rows", "causal", "none"])
def test_fused_form_matches_sdpa_under_compile(case):
    """The int8 models' compiled attention as the one C++ op (kernels/cpu_attention.py) against float64
    SDPA: within bf16's rounding, SDPA's zeros for a row that sees no key, and the op really called
    (causal stays the unfused form, which the op does not take)."""
    from torchkiln.kernels import cpu_attention
    from torchkiln.passes.sdpa_math import low_math_attention

    if cpu_attention.load() is not None:
        pytest.skip(cpu_attention.load())
    q, k, v = qkv()
    kw = {"is_causal": case == "causal"}
    if case == "bool_mask_dead_row":
        kw["attn_mask"], _ = left_padded_mask()
        kw["attn_mask"][1, 0, 2] = False  # a row that sees no key
    if case == "float_mask":
        kw["attn_mask"] = torch.randn(2, 1, 16, 16)
    if case == "mask_b1_rows":
        m = torch.rand(1, 1, 16, 16) > 0.3
        m[..., 0] = True
        m[0, 0, 4] = False
        kw["attn_mask"] = m

    def f(q, k, v, m):
        return low_math_attention(q, k, v, m, kw["is_causal"], None, False, opaque_softmax=True, fused=True)

    out, names = profiled(lambda: torch.compile(f, fullgraph=True)(q, k, v, kw.get("attn_mask")))
    assert ("torchkiln::attention_bf16" in names) == (case != "causal")
    ref = ref_sdpa(q, k, v, **kw).nan_to_num(0.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)


def test_opaque_softmax_only_for_the_bf16_form_when_compiled(monkeypatch):
    """The router hands the inline math-bf16 form the opaque softmax, the float math form not
    (measured slower there: FORMS); eager, both stay the custom ops."""
    from torchkiln.passes import sdpa_math as sm

    r = SDPARouter(mode="auto-bf16")
    q, k, v = qkv()
    b = sm.bind_sdpa((q, k, v), {})
    key = sm._key(b)
    for form, opaque in (("math", False), ("math-bf16", True)):
        r.choices = {key: form}
        assert r._route(b) is getattr(torch.ops.torchkiln, sm.FORMS[form][1])  # eager
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            inline = r._route(b)
        fused = {"fused": r.fused} if form == "math-bf16" else {}
        assert inline.func is sm.FORMS[form][0] and inline.keywords == {"opaque_softmax": opaque, **fused}
    r.opaque_softmax = False  # the switch benchmarks/diag_opaque_softmax.py uses
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert r._route(b).keywords == {"opaque_softmax": False, "fused": r.fused}


@pytest.mark.parametrize("choices", [("math",), ("math", "sdpa")], ids=["one-form", "mixed"])
def test_a_graph_compiled_for_many_lengths_is_not_recompiled_per_length(choices):
    """Traced, the router never looks a shape up: a lookup guards on the sizes (dynamo reads symbolic
    sizes as ints), and a tiny BERT with padding per batch recompiled at every new length (3-5 s each
    on a 2-core Zen 5), a small BART (mixed choices) too."""
    from torch._dynamo.utils import counters

    r = SDPARouter()
    lengths = (16, 24, 32, 40)
    r.calibrating = True
    with r:
        for L in lengths[:len(choices)]:
            F.scaled_dot_product_attention(*qkv(L=L, S=L))
    r.calibrating = False
    r.choices = dict(zip(r.choices, choices, strict=True))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    with r:
        for L in lengths:
            q, k, v = qkv(L=L, S=L)
            torch.testing.assert_close(compiled(q, k, v).double(), ref_sdpa(q, k, v) * 2, rtol=1e-5, atol=1e-5)
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs == 2  # static, then one dynamic graph


def test_traced_form_of_mixed_choices_is_the_least_total_time():
    r = SDPARouter()
    a, b, c = ((((1, 4, n, 8),) * 3, "torch.float32", False, False) for n in (128, 32, 48))
    r.choices = {a: "math", b: "sdpa", c: "sdpa"}
    r.timings = {a: {"math": 142e-6, "sdpa": 145e-6}, b: {"math": 43e-6, "sdpa": 28e-6}, c: {"math": 54e-6, "sdpa": 47e-6}}
    rest = ("torch.float32", False, False)
    assert r._traced_form(rest) == "sdpa"  # 220 us against 239
    r.timings[a] = {"math": 100e-6, "sdpa": 145e-6}
    assert r._traced_form(rest) == "math"  # 197 against 220
    r.timings = {}
    assert r._traced_form(rest) == "sdpa"  # unmeasured: the most chosen
    assert r._traced_form(("torch.bfloat16", False, False)) is None  # nothing measured for bf16: SDPA as called
