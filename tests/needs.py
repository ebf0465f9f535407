"""Skip markers for what an installed library may lack, shared by the test files."""

import pytest

from torchkiln.quantization import pt2e_flow

# torchao 0.10 (what pip gives torch 2.6) has no pt2e flow: the CPU int8 graph schemes (int8-static,
# int8-smoothquant, int8-dynamic) then raise a clear ImportError, tested in
# tests/quantization/test_quantize.py::test_the_pt2e_flow_missing_is_a_clear_error, and what needs them skips.
_NO_PT2E = pt2e_flow.missing()
pt2e = pytest.mark.skipif(_NO_PT2E is not None, reason=f"no pt2e flow: {_NO_PT2E}")
