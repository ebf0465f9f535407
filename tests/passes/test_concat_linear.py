import copy

import torch
from torch import nn

from torchkiln.passes import concat_linear
from torchkiln.passes.concat_linear import ConcatSlice, find_groups


class Attn(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x, memory=None):
        kv = x if memory is None else memory
        q, k, v = self.q(x), self.k(kv), self.v(kv)
        a = torch.softmax(q @ k.transpose(-1, -2) / 4, -1)
        return self.o(a @ v)


def test_qkv_fused_and_matches_eager():
    m = Attn().eval()
    x = torch.randn(2, 5, 32)
    ref = m(x)
    out = concat_linear(copy.deepcopy(m), (x,), {})
    assert all(isinstance(getattr(out, n), ConcatSlice) for n in "qkv")
    assert isinstance(out.o, nn.Linear)
    torch.testing.assert_close(out(x), ref, rtol=1e-5, atol=1e-5)
    # A later call with other data: still right (the cache is keyed on the input object).
    x2 = torch.randn(3, 5, 32)
    torch.testing.assert_close(out(x2), m(x2), rtol=1e-5, atol=1e-5)


def test_cross_attention_groups_only_k_and_v():
    m = Attn().eval()
    x, mem = torch.randn(1, 4, 32), torch.randn(1, 6, 32)
    groups = find_groups(m, (x, mem), {})
    assert groups == [("", ["k", "v"])]
    out = concat_linear(copy.deepcopy(m), (x, mem), {})
    torch.testing.assert_close(out(x, mem), m(x, mem), rtol=1e-5, atol=1e-5)
    # Wrong guess is still correct: called self-attention style, q/k/v each compute.
    torch.testing.assert_close(out(x), m(x), rtol=1e-5, atol=1e-5)


def test_chained_linears_in_sequential_are_not_grouped():
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    assert find_groups(m, (torch.randn(2, 8),), {}) == []


def test_compiles():
    m = Attn().eval()
    x = torch.randn(2, 5, 32)
    out = torch.compile(concat_linear(copy.deepcopy(m), (x,), {}), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(out(x), m(x), rtol=1e-5, atol=1e-5)


def test_fused_linear_lives_with_its_siblings():
    # The fused weight is made where the siblings are (a CUDA model got a CPU weight once).
    from torchkiln.passes.concat_linear import _Group

    lin = [nn.Linear(8, 8, device="meta", dtype=torch.bfloat16) for _ in range(3)]
    g = _Group(lin)
    assert g.fused.weight.device.type == "meta" and g.fused.weight.dtype == torch.bfloat16
    assert g.fused.weight.shape == (24, 8)
