"""passes/hash_dropout.py: counter-hash dropout masks for compiled CPU training steps."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkiln.passes import hash_dropout as hd


def _seed(a: int, b: int) -> torch.Tensor:
    return torch.tensor([a, b], dtype=torch.int32)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_mask_keeps_one_minus_p(p):
    n = 1 << 20
    keep = hd.keep_mask((n,), p, _seed(12345, -678), "cpu").float()
    # the mean of n Bernoulli(1 - p) draws: 6 standard deviations
    assert abs(keep.mean().item() - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float() - a.float().mean(), b.float() - b.float().mean()
    return (a * b).mean().item() / (a.std() * b.std()).item()


def test_masks_are_uncorrelated_across_elements_rows_and_seeds():
    shape = (256, 768)
    m = hd.keep_mask(shape, 0.5, _seed(1, 2), "cpu")
    flat = m.flatten()
    bound = 6 / math.sqrt(flat.numel())  # 6 sigma for independent draws
    assert abs(_corr(flat[:-1], flat[1:])) < bound  # neighbours
    assert abs(_corr(m[:-1], m[1:])) < bound  # the same column in consecutive rows
    for other in (_seed(1, 3), _seed(2, 2), _seed(0, 0)):  # a one-bit change of either word
        assert abs(_corr(m, hd.keep_mask(shape, 0.5, other, "cpu"))) < bound


def test_the_hash_bits_are_uniform():
    idx = torch.arange(1 << 18, dtype=torch.int32)
    h = hd._mix(hd._mix(idx ^ 7) + 99)
    top = (h >> 28) & 0xF  # 16 bins of the top bits
    counts = torch.bincount(top.long(), minlength=16).double()
    expected = idx.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 45  # 15 degrees of freedom: p ~ 1e-4


def _capture(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def test_rewritten_dropout_matches_its_mask_forward_and_backward():
    x = torch.randn(64, 96, requires_grad=True)
    gm = _capture(lambda t: F.dropout(t, 0.25, training=True), x)
    assert hd.rewrite(gm.graph) == 1
    gm.recompile()
    torch.manual_seed(3)
    out = gm(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.manual_seed(3)
    seed = hd.new_seeds(1, "cpu")[0]
    keep = hd.keep_mask(x.shape, 0.25, seed, "cpu")
    torch.testing.assert_close(out, torch.where(keep, x / 0.75, 0.0), rtol=1e-6, atol=0)
    w = torch.randn_like(x)
    (out * w).sum().backward()
    torch.testing.assert_close(x.grad, torch.where(keep, w / 0.75, 0.0), rtol=1e-6, atol=0)


def test_every_call_draws_new_masks_and_manual_seed_repeats_them():
    x = torch.ones(32, 64)
    f = torch.compile(lambda t: F.dropout(t, 0.5, training=True), options={"pre_grad_custom_pass": hd.HashDropoutPass()})
    torch.manual_seed(0)
    a, b = f(x), f(x)
    torch.manual_seed(0)
    a2 = f(x)
    assert not torch.equal(a, b)
    assert torch.equal(a, a2)
    assert set(a.unique().tolist()) <= {0.0, 2.0}


def test_attention_dropout_is_the_math_form_with_the_mask_on_the_probabilities():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16) for _ in range(3))
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    mask[1, :, :, 5:] = False
    seed = _seed(5, 6)
    got = hd.attention_dropout(q, k, v, mask, 0.3, False, None, False, seed)
    s = (q @ k.transpose(-2, -1)) / 4.0
    probs = s.masked_fill(~mask, float("-inf")).softmax(-1)
    keep = hd.keep_mask(probs.shape, 0.3, seed, "cpu")
    ref = torch.where(keep, probs / 0.7, 0.0) @ v
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # without dropout it is SDPA itself
    torch.testing.assert_close(hd.math_attention(q, k, v, mask, False, None, False),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-5)


def test_sdpa_with_dropout_in_a_graph_is_rewritten_with_its_own_seed():
    qkv = torch.randn(3, 1, 2, 8, 16)
    q, k, v = qkv.unbind(0)

    def f(qkv):  # one input: dynamo orders several placeholders differently across torch versions
        h = F.scaled_dot_product_attention(*qkv.unbind(0), dropout_p=0.2, is_causal=True)
        return F.dropout(h, 0.1, training=True)
    gm = _capture(f, qkv)
    assert hd.rewrite(gm.graph) == 2
    gm.recompile()
    torch.manual_seed(9)
    out = gm(qkv)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.manual_seed(9)
    seeds = hd.new_seeds(2, "cpu")
    attn = hd.attention_dropout(q, k, v, None, 0.2, True, None, False, seeds[0])
    torch.testing.assert_close(out, hd.hash_dropout(attn, 0.1, seeds[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [
    lambda t: F.dropout(t, 0.3, training=False),  # eval: dropout is the identity
    lambda t: F.dropout(t, 0.0, training=True),  # nothing to drop
    lambda t: F.dropout(t.clone(), 0.3, True, True),  # in place: left to torch
    lambda t: nn.functional.scaled_dot_product_attention(t, t, t),  # no dropout
])
def test_what_is_not_training_dropout_is_left_alone(fn):
    x = torch.randn(1, 2, 4, 8)
    gm = _capture(fn, x)
    before = [n.target for n in gm.graph.nodes]
    assert hd.rewrite(gm.graph) == 0
    assert [n.target for n in gm.graph.nodes] == before


def test_graph_passes_key_inductor_cache_on_their_source():
    from torchkiln.passes.gelu_epilogue import GeluEpiloguePass
    from torchkiln.passes.registry import GraphPass, graph_pass, make

    a, b = hd.HashDropoutPass(), GeluEpiloguePass()
    assert isinstance(a, GraphPass) and a.uuid() == hd.HashDropoutPass().uuid() != b.uuid()
    assert hd.HashDropoutPass(devices=("cuda",), attention=False).uuid() != a.uuid()  # another rewrite, another key
    chain = graph_pass([make("gelu_epilogue"), make("hash_dropout")])
    assert isinstance(chain, GraphPass) and chain.uuid() == b.uuid() + a.uuid()
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # older torch: nothing to key on
        return
    assert isinstance(a, CustomGraphPass) and isinstance(chain, CustomGraphPass)
