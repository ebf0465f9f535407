"""llm/fused.py: which norms and activations qualify (CPU), the folded int8 kernels against a
float64 reference written without them, and the folded decode against the unfolded one (CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

import torchkiln as tk  # noqa: E402
from torchkiln.llm import fused, qkv_rope  # noqa: E402

from .families import build  # noqa: E402

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_rms_form_reads_llama_and_gemma_norms_and_refuses_others():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    llama, gemma = LlamaRMSNorm(64, eps=1e-5), GemmaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
    x = torch.randn(5, 64)
    for norm, eps in ((llama, 1e-5), (gemma, 1e-6)):
        g, got_eps = fused.rms_form(norm, 64)
        assert got_eps == eps and g.dtype == torch.float32
        torch.testing.assert_close(_rms(x, eps) * g, norm(x).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.rms_form(gemma, 64)[0], 1 + gemma.weight.detach())
    assert fused.rms_form(nn.LayerNorm(64), 64) is None  # has a bias and subtracts the mean
    assert fused.rms_form(nn.LayerNorm(64, bias=False), 64) is None  # subtracts the mean
    assert fused.rms_form(llama, 128) is None  # another width

    class Scaled(nn.Module):  # an RMS norm that also scales by 2: not what its weight says
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.randn(64)), 1e-6

        def forward(self, x):
            return 2 * _rms(x, self.eps) * self.weight

    assert fused.rms_form(Scaled(), 64) is None


def test_is_silu_by_value():
    assert fused.is_silu(nn.SiLU())
    from transformers.activations import ACT2FN

    assert fused.is_silu(ACT2FN["silu"])
    assert not fused.is_silu(nn.GELU()) and not fused.is_silu(ACT2FN["gelu_pytorch_tanh"])


def test_nothing_folds_on_the_cpu():
    model = build("llama", intermediate_size=128)
    fast = tk.llm.optimize(model, dtype=torch.float32, quant="int8", compile=False)
    assert fast.kiln_report.folded is None and fast.kiln_report.rope is None
    assert all(layer.folded is None and not layer.rope_kernel for layer in fast._kiln_runner.decoder.layers)


def test_rope_folds_only_where_the_rotation_is_whole_and_follows_the_projection():
    from torchkiln.llm.spec import read

    def fits(name, **kw):
        model = build(name, **kw)
        return qkv_rope.fits(read(model)[0])

    assert fits("llama") and fits("qwen2") and fits("gemma") and fits("mistral")
    assert not fits("qwen3")  # q/k norms between the projection and the rotation
    assert fits("phi3") and not fits("phi3", partial_rotary_factor=0.5)  # half of each head rotates
    assert not fits("gpt_neox")  # headwise rows
    assert not fits("gpt2")  # learned positions


cuda = pytest.mark.cuda


def _reference(x, q, g, eps, gated, bias, resid):
    w = q.weight.double() * q.scales.double()[:, None]
    h = x.double()
    if g is not None:
        h = _rms(h, eps) * g.double()
    y = h @ w.t()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if bias is not None:
        y = y + bias.double()
    return y if resid is None else y + resid.double()


# Each (N, K, flags) is its own autotune key (a dozen compiles): few shapes. (70, 192): masked row
# tails, 48 words a row; (1024, 4096): tiles as in Llama's layers.
FLAGS = [(True, False, False, False), (True, True, False, False), (False, False, False, True),
         (True, False, True, False), (False, False, True, True)]
CASES = ([("words", torch.bfloat16, 70, 192, *f) for f in FLAGS] + [("bytes", torch.bfloat16, 70, 192, *f) for f in FLAGS]
         + [(m, torch.bfloat16, 1024, 4096, True, True, False, False) for m in ("words", "bytes")]
         + [("bytes", torch.float16, 70, 192, True, False, True, True)])


@cuda
@pytest.mark.parametrize("mode,dtype,n,k,norm,gated,bias,resid", CASES)
def test_folded_kernels_match_float64(mode, dtype, n, k, norm, gated, bias, resid, monkeypatch):
    from torchkiln.quantization import gemv
    from torchkiln.quantization.weight_only import Int8Linear

    monkeypatch.setattr(gemv, "ONE_ROW", mode)
    torch.manual_seed(n + k)
    lin = nn.Linear(k, 2 * n if gated else n, bias=bias, device="cuda", dtype=dtype)
    q = Int8Linear(lin)
    x = torch.randn(1, 1, k, device="cuda", dtype=dtype) * 3
    g = torch.rand(k, device="cuda") + 0.5 if norm else None
    r = torch.randn(1, 1, n, device="cuda", dtype=dtype) if resid else None
    got = gemv.int8_fused(x, q, g, 1e-5, gated, r)
    ref = _reference(x, q, g, 1e-5, gated, lin.bias, r)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 8e-3, err  # the output's rounding: ~4e-3 in bf16
    unfused = q(x if g is None else (_rms(x.float(), 1e-5) * g).to(dtype))  # the same through the plain op
    if not gated:
        unfused = unfused + (r if r is not None else 0)
        assert float((unfused.double() - ref).norm() / ref.norm()) < 8e-3


@cuda
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_folded_decode_matches_the_unfolded_one(family, quant, monkeypatch):
    """The int8 decode, and the int4 one in torchkiln's CUDA kernel, with norms, residuals and silu * up
    inside the GEMVs (llama: all of them; qwen2: q/k/v bias in the epilogue; gemma: 1 + w norms, GELU
    kept outside) against the same model with nothing folded: the same greedy tokens, logits within
    bf16 rounding."""
    from torchkiln.quantization.weight_only import Int4Linear, Int8Linear

    model = build(family, seed=3, intermediate_size=128).cuda()
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=12, output_logits=True, return_dict_in_generate=True, **GREEDY)
    folded = tk.llm.optimize(model, dtype=torch.bfloat16, quant=quant, max_seq_len=64)
    assert folded.kiln_report.folded == 2 and "inside the GEMVs: 2" in str(folded.kiln_report)
    layers = folded._kiln_runner.decoder.layers
    assert all(la.folded is not None for la in layers)
    assert all(la.folded.gated == (family != "gemma") and la.rope_kernel for la in layers)
    # the final norm folds into the head, int8 after int8 layers, int4 after int4 ones (quant.INT4_HEAD)
    head = folded._kiln_runner.decoder.head
    assert folded._kiln_runner.decoder.head_g is not None and folded.kiln_report.quant_head == quant
    assert isinstance(head, Int4Linear if quant == "int4" else Int8Linear)
    if quant == "int4":
        assert head.mma and folded._kiln_runner.decoder.head_config >= 0
        assert all(isinstance(la.qkv, Int4Linear) and la.qkv.mma for la in layers)
        assert all(la.folded.qkv_config >= 0 and la.folded.up_config >= 0 for la in layers)
    monkeypatch.setattr(fused, "ON", False)
    plain = tk.llm.optimize(model, dtype=torch.bfloat16, quant=quant, max_seq_len=64)
    assert plain.kiln_report.folded is None
    a, b = folded.generate(ids, **kw), plain.generate(ids, **kw)
    if quant == "int8":
        assert torch.equal(a.sequences, b.sequences)
    # int4: the same tokens up to a near-tie (qwen2's seventh new token parted on the H200, 20 against
    # 71, after a run of 71s), where the folded step's choice is within 2% of the unfolded one's top logit
    differ = (a.sequences[0, ids.shape[1]:] != b.sequences[0, ids.shape[1]:]).nonzero()
    upto = int(differ[0]) if len(differ) else len(b.logits)
    assert upto >= 4, (a.sequences, b.sequences)
    for la, lb in zip(a.logits[:upto + 1], b.logits[:upto + 1], strict=True):
        assert float((la - lb).norm() / lb.norm()) < 2e-2
    if upto < len(b.logits):
        lb = b.logits[upto][0]
        assert float(lb.max() - lb[a.sequences[0, ids.shape[1] + upto]]) <= 0.02 * float(lb.abs().max())


def _rotate(t, cos, sin):
    a, b = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-b, a), dim=-1) * sin


@cuda
def test_an_int8_head_after_int4_layers_keeps_its_norm_unfolded(monkeypatch):
    """quant.INT4_HEAD off: the head goes int8 and the final norm stays the compiler's (fused.fold says
    why); its logits over three steps (two of them one-row decode steps, where folding happens) within
    bf16 rounding of the same build with nothing folded."""
    from torchkiln.llm import quant as llm_quant
    from torchkiln.quantization.weight_only import Int8Linear

    model = build("llama", seed=3, intermediate_size=128).cuda()
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=3, output_logits=True, return_dict_in_generate=True, **GREEDY)
    monkeypatch.setattr(llm_quant, "INT4_HEAD", False)
    fast = tk.llm.optimize(model, dtype=torch.bfloat16, quant="int4", max_seq_len=64)
    d = fast._kiln_runner.decoder
    assert isinstance(d.head, Int8Linear) and d.head_g is None and fast.kiln_report.quant_head == "int8"
    assert fast.kiln_report.folded == 2
    monkeypatch.setattr(fused, "ON", False)
    plain = tk.llm.optimize(model, dtype=torch.bfloat16, quant="int4", max_seq_len=64)
    a, b = torch.cat(fast.generate(ids, **kw).logits), torch.cat(plain.generate(ids, **kw).logits)
    assert a.shape == (3, 96) and float((a - b).norm() / b.norm()) < 2e-2


@cuda
@pytest.mark.parametrize("heads,kv,d,k,norm,bias", [(4, 2, 16, 192, True, False), (8, 2, 64, 256, False, True),
                                                     (32, 8, 128, 4096, True, False)])
def test_qkv_rope_kernel_matches_float64(heads, kv, d, k, norm, bias):
    """q/k/v GEMV + RoPE + cache write against float64: q rotated by the position's row of the
    tables, k rotated and v written at the slot, every other cache slot untouched."""
    from torchkiln.llm.qkv_rope import qkv_rope, register
    from torchkiln.quantization.weight_only import Int8Linear

    register()
    torch.manual_seed(d + k)
    dt = torch.bfloat16
    lin = nn.Linear(k, (heads + 2 * kv) * d, bias=bias, device="cuda", dtype=dt)
    q8 = Int8Linear(lin)
    x = torch.randn(1, 1, k, device="cuda", dtype=dt) * 3
    g = torch.rand(k, device="cuda") + 0.5 if norm else None
    ang = torch.rand(50, d // 2, device="cuda") * 6  # a table of 50 positions
    cos, sin = torch.cat((ang, ang), -1).cos().to(dt), torch.cat((ang, ang), -1).sin().to(dt)
    kc, vc = torch.randn(2, 1, kv, 40, d, device="cuda", dtype=dt)
    k0, v0 = kc.clone(), vc.clone()
    slot = torch.tensor([17], device="cuda")
    q = qkv_rope(x, q8, g, 1e-5, cos, sin, torch.tensor([[23]], device="cuda"), slot, kc, vc, heads)
    y = _reference(x, q8, g, 1e-5, False, lin.bias, None).view(heads + 2 * kv, d)
    c, s = cos[23].double(), sin[23].double()
    ref_q, ref_k, ref_v = _rotate(y[:heads], c, s), _rotate(y[heads:heads + kv], c, s), y[heads + kv:]
    assert q.shape == (1, heads, 1, d) and q.dtype == dt

    def err(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert err(q[0, :, 0], ref_q) < 8e-3 and err(kc[0, :, 17], ref_k) < 8e-3 and err(vc[0, :, 17], ref_v) < 8e-3
    others = torch.arange(40, device="cuda") != 17
    assert torch.equal(kc[:, :, others], k0[:, :, others]) and torch.equal(vc[:, :, others], v0[:, :, others])


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_rope_cache_kernel_matches_rotate_and_index_copy(dtype, tol):
    """The float/int4 steps' rotation + cache write against the decoder's own rotate() and
    index_copy_ (what it replaces), in float64 from the same rounded q/k/v."""
    from torchkiln.llm.model import rotate

    qkv_rope.register()
    heads, kv, d = 8, 2, 64
    torch.manual_seed(1)
    qkv = torch.randn(1, 1, (heads + 2 * kv) * d, device="cuda", dtype=dtype)
    ang = torch.rand(30, d // 2, device="cuda") * 6
    cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
    kc, vc = torch.randn(2, 1, kv, 20, d, device="cuda", dtype=dtype)
    k0, v0 = kc.clone(), vc.clone()
    q = qkv_rope.rope_cache(qkv, cos, sin, torch.tensor([[29]], device="cuda"), torch.tensor([3], device="cuda"),
                            kc, vc, heads)
    y = qkv.double().view(heads + 2 * kv, d)[:, None]  # (heads, T=1, D)
    c, s = cos[29].double(), sin[29].double()
    ref_k = rotate(y[heads:heads + kv], c, s)[None]
    k0.index_copy_(2, torch.tensor([3], device="cuda"), ref_k.to(dtype))
    v0.index_copy_(2, torch.tensor([3], device="cuda"), y[None, heads + kv:].to(dtype))
    torch.testing.assert_close(q.double(), rotate(y[:heads], c, s)[None], rtol=tol, atol=tol)
    torch.testing.assert_close(kc, k0, rtol=tol, atol=tol)
    torch.testing.assert_close(vc, v0, rtol=0, atol=0)  # v is only copied


@cuda
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_decode_with_the_rope_kernel_matches_inductors(family, monkeypatch):
    """bf16 decode rotating in qkv_rope's kernel against inductor's rotation: the same greedy tokens
    and logits within bf16 rounding; families it cannot serve keep inductor's."""
    model = build(family, seed=3, intermediate_size=128).cuda()
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=12, output_logits=True, return_dict_in_generate=True, **GREEDY)
    fast = tk.llm.optimize(model, dtype=torch.bfloat16, max_seq_len=64)
    assert all(la.rope_kernel for la in fast._kiln_runner.decoder.layers)
    assert fast.kiln_report.rope == 2 and "cache writes in one kernel: 2" in str(fast.kiln_report)
    monkeypatch.setattr(qkv_rope, "ROPE", False)
    plain = tk.llm.optimize(model, dtype=torch.bfloat16, max_seq_len=64)
    assert not any(la.rope_kernel for la in plain._kiln_runner.decoder.layers)
    a, b = fast.generate(ids, **kw), plain.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits, strict=True):
        assert float((la - lb).norm() / lb.norm()) < 2e-2
    monkeypatch.setattr(qkv_rope, "ROPE", True)
    qwen3 = tk.llm.optimize(build("qwen3").cuda(), dtype=torch.bfloat16, max_seq_len=64)
    assert not any(la.rope_kernel for la in qwen3._kiln_runner.decoder.layers)  # q/k norms
    assert qwen3.kiln_report.rope == 0
