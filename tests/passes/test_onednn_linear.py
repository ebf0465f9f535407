import copy

import pytest
import torch
from torch import nn

from torchkiln.passes import OneDNNLinear, onednn_linear
from torchkiln.passes.onednn_linear import available, input_rows, measure

pytestmark = pytest.mark.skipif(not available(torch.float32), reason="torch built without oneDNN")


@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 48)])
def test_matches_float64_reference(shape):
    m = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 24, bias=False)).eval()
    x = torch.randn(*shape)
    ref = m.double()(x.double())
    m.float()
    out = onednn_linear(m, input_rows(m, (x,), {}))
    assert isinstance(out[0], OneDNNLinear) and isinstance(out[2], OneDNNLinear)
    torch.testing.assert_close(out(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_input_rows_counts_gemm_rows():
    m = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    rows = input_rows(m, (torch.randn(3, 5, 8),), {})
    assert rows == {m[0]: 15, m[1]: 15}


def test_parameters_are_shared_not_copied():
    lin = nn.Linear(8, 8)
    out = onednn_linear(nn.Sequential(lin))
    assert out[0].weight is lin.weight
    assert set(out.state_dict()) == {"0.weight", "0.bias"}  # packed copy is not persistent


@pytest.mark.skipif(not available(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_bf16():
    m = nn.Linear(64, 32).eval()
    x = torch.randn(4, 64)
    ref = m(x).double()
    out = onednn_linear(nn.Sequential(m.to(torch.bfloat16)))
    y = out(x.bfloat16()).double()
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2


def _gpt2(dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)
    return transformers.GPT2Model(cfg).eval().to(dtype)


def test_gpt2s_conv1d_layers_are_routed_and_match_a_float64_reference():
    """transformers' Conv1D keeps its weight as (in, out): packed as (out, in), it must give the same
    answer as the layer it replaces. Before, GPT-2's GEMMs were never routed (gpt2 fp32 bs1 0.92x
    the stock compile on a 2-core Zen 4, 1.52x after; RESULTS.md, thirty-fourth session)."""
    from transformers.pytorch_utils import Conv1D

    model = _gpt2()
    ids = torch.randint(0, 100, (2, 9))
    ref = copy.deepcopy(model).double()(ids).last_hidden_state
    kept = {n: m.weight for n, m in model.named_modules() if isinstance(m, Conv1D)}
    rows = input_rows(model, (ids,), {})
    assert sorted(set(rows.values())) == [18] and len(rows) == len(kept) == 8  # 2 x 9 tokens, every Conv1D
    out = onednn_linear(model, rows)
    layers = dict(out.named_modules())
    assert all(isinstance(layers[n], OneDNNLinear) and layers[n].weight is w for n, w in kept.items())
    assert (layers["h.0.mlp.c_fc"].in_features, layers["h.0.mlp.c_fc"].out_features) == (64, 256)
    torch.testing.assert_close(out(ids).last_hidden_state.double(), ref, rtol=1e-5, atol=1e-5)


def test_measure_reports_both_paths():
    r = measure(torch.float32, 64, 128, 128, iters=3)
    assert set(r) == {"aten", "onednn"} and all(v > 0 for v in r.values())


class _Acts(nn.Module):
    """Each activation form torchkiln fuses, one not fused (the GEMM output has a second user), and a
    plain linear; reference: the same layers as nn.Linear in float64."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))  # erf form
        h = torch.nn.functional.silu(self.b(h)) + torch.nn.functional.gelu(self.b(h), approximate="tanh")
        r = self.c(h)
        h = torch.relu(r) + r  # r is used twice: not fused
        return self.d(h).relu() + torch.nn.functional.relu(self.d(h), inplace=True)


def _compiled(model, x, graph_pass):
    import torch._inductor.config as inductor_config
    # no FX graph cache: on a hit the pass does not run, and the test counts its rewrites
    with torch.no_grad(), inductor_config.patch({"pre_grad_custom_pass": graph_pass, "fx_graph_cache": False,
                                                 "freezing": True}):
        torch._dynamo.reset()
        return torch.compile(model)(x)


def test_activations_fuse_into_the_gemm_with_eager_numerics():
    from torchkiln.passes.onednn_linear import FuseActivations
    torch.manual_seed(0)
    m, x = _Acts().eval(), torch.randn(3, 5, 16)
    ref = m.double()(x.double())
    m.float()
    fast = onednn_linear(m, input_rows(m, (x,), {}))
    p = FuseActivations()
    out = _compiled(fast, x, p)
    assert p.fused == 5  # gelu, silu, gelu-tanh, .relu(), relu in place; not relu(r) where r has another user
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_the_fusion_comes_with_the_pass_config():
    from torchkiln.passes import registry
    from torchkiln.passes.onednn_linear import FuseActivations, OneDNNLinearConfig
    assert isinstance(registry.graph_pass([OneDNNLinearConfig()]), FuseActivations)
