"""Skip markers for what an installed library may lack, shared by the test files."""

import pytest

from torchkiln.hardware import detect
from torchkiln.quantization import pt2e_flow

# torchao 0.10 (what pip gives torch 2.6) has no pt2e flow: the CPU int8 graph schemes (int8-static,
# int8-smoothquant, int8-dynamic) then raise a clear ImportError, tested in
# tests/quantization/test_quantize.py::test_the_pt2e_flow_missing_is_a_clear_error, and what needs them skips.
_NO_PT2E = pt2e_flow.missing()
pt2e = pytest.mark.skipif(_NO_PT2E is not None, reason=f"no pt2e flow: {_NO_PT2E}")

# What this CPU runs in hardware. bf16 CPU candidates are planned only where bf16 is native
# (plan/cpu.py choose_dtype keeps float32 elsewhere), and oneDNN's int8 kernels without a dot-product
# instruction (VNNI) sum in 16 bits, which can saturate: tests of behaviour that only exists there
# skip elsewhere, naming why (seen on an AVX2-only dev machine, forty-second session).
_CPU = detect().cpu
bf16_cpu = pytest.mark.skipif(not _CPU.bf16_native, reason="this CPU has no native bf16 (AVX512_BF16, AMX, Arm "
                              "BF16): torchkiln plans no bf16 CPU candidates here")
int8_dot_cpu = pytest.mark.skipif(not _CPU.int8_dot, reason="this CPU has no int8 dot-product instruction (VNNI, "
                                  "AMX-INT8, i8mm/dotprod): oneDNN's int8 sums differ here")
