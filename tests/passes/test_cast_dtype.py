import copy

import pytest
import torch
from torch import nn

from torchkiln.passes import Fp32Island, cast_dtype


def test_sensitive_modules_stay_fp32_and_error_is_bf16_sized():
    m = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 10), nn.Softmax(-1)).eval()
    x = torch.randn(4, 32)
    ref = m(x).double()
    out = cast_dtype(m, torch.bfloat16)
    assert out[0].weight.dtype == torch.bfloat16
    assert isinstance(out[1], Fp32Island) and out[1].module.weight.dtype == torch.float32
    assert isinstance(out[4], Fp32Island)
    y = out(x.bfloat16())
    assert y.dtype == torch.bfloat16
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel  # bf16 has ~3 significant digits


def test_float32_is_a_no_op():
    m = nn.Linear(2, 2)
    assert cast_dtype(m, torch.float32).weight.dtype == torch.float32


def test_islands_answer_for_the_module_they_wrap():
    """nn.TransformerEncoderLayer reads its norms' weight and eps in forward: with the norms as
    fp32 islands in a bf16 model it runs, and matches the float32 model (bf16 tolerance)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = layer(x)
        low = cast_dtype(copy.deepcopy(layer).to(torch.bfloat16), torch.bfloat16)
        assert isinstance(low.norm1, Fp32Island) and low.norm1.eps == layer.norm1.eps
        assert low.norm1.weight.dtype == torch.float32 and low.norm1.weight is low.norm1.module.weight
        out = low(x.bfloat16()).float()
    assert float((out - ref).norm() / ref.norm()) < 2e-2
    with pytest.raises(AttributeError, match="no_such_thing"):
        low.norm1.no_such_thing  # noqa: B018 (the access is the test)
