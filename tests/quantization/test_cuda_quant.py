"""CUDA schemes: weight-only int8/int4 (torchkiln's layers: Triton GEMV, tinygemm), per-token int8 dynamic and fp8 (torchao)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import torchkiln as tk

pytestmark = pytest.mark.cuda


def sqnr_db(ref, q):
    ref, q = ref.detach().double(), q.detach().double()
    return 10 * math.log10(float(ref.pow(2).sum()) / float((ref - q).pow(2).sum()))


@pytest.mark.parametrize("scheme,floor", [("int8-weight-only", 30), ("int4-weight-only", 15),
                                          ("int8-dynamic", 25), ("fp8", 20)])
def test_cuda_scheme(scheme, floor):
    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).cuda().to(torch.bfloat16).eval()
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = tk.quantize(m, scheme, calib_data=[x], progress=False)
        fast = tk.optimize(q, sample_input=x, time_budget=0.5)
    ref = m(x).float()
    assert q.kiln_quant.backend == ("kernels" if scheme.endswith("weight-only") else "torchao")
    assert sqnr_db(ref, q(x).float()) > floor
    assert sqnr_db(ref, fast(x).float()) > floor
    assert fast.kiln_report.quantization["scheme"] == scheme


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_weight_only_kernels_at_decode_and_batch_sizes(rows):
    """The kernels backend on CUDA: the Triton GEMV (<= 4 rows) and the dequantizing matmul beyond,
    eager and through tk.optimize (compiled, CUDA graphs), against the float model."""
    from torchkiln.quantization.weight_only import Int8Linear

    torch.manual_seed(rows)
    m = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).cuda().to(torch.bfloat16).eval()
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = tk.quantize(m, "int8-weight-only", calib_data=[x], progress=False)
        fast = tk.optimize(q, sample_input=x, time_budget=0.5)
    assert all(isinstance(q[i], Int8Linear) and q[i].kernel for i in (0, 2))
    ref = m(x).float()
    assert sqnr_db(ref, q(x).float()) > 30 and sqnr_db(ref, fast(x).float()) > 30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gptq_int4_on_cuda_beats_nearest_rounding(dtype):
    """GPTQ's codes in tinygemm's packing (bf16) and in the Triton GEMV's layout (float32), on the GPU,
    at decode (1 row) and batch (64 rows) sizes: closer to the float model than rounding to nearest."""
    from .test_gptq import correlated

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).cuda().to(dtype).eval()
    calib = [correlated(128, 256, seed=i).cuda().to(dtype) for i in range(4)]
    held = correlated(64, 256, seed=99).cuda().to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = tk.quantize(m, "int4-weight-only", calib_data=calib, group_size=32, auto_fallback=False, progress=False)
        r = tk.quantize(m, "int4-weight-only", calib_data=calib, group_size=32, gptq=False, auto_fallback=False,
                        progress=False)
    assert g.kiln_quant.config.gptq and g.kiln_quant.backend == "kernels"
    with torch.no_grad():
        for x in (held[:1], held):
            ref = m(x).float()
            assert sqnr_db(ref, g(x).float()) > sqnr_db(ref, r(x).float()) + 3
