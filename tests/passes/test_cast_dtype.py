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
