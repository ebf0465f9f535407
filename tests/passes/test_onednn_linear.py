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


def test_measure_reports_both_paths():
    r = measure(torch.float32, 64, 128, 128, iters=3)
    assert set(r) == {"aten", "onednn"} and all(v > 0 for v in r.values())
