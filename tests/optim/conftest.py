import pytest

from torchkiln.optim import kernels


@pytest.fixture(autouse=True, params=["compiled", "foreach"])
def form(request, monkeypatch):
    """Every optimizer test runs in both forms: the compiled per-tensor kernels and the
    _foreach form they fall back to when compilation is unavailable."""
    if request.param == "foreach":
        monkeypatch.setitem(kernels._state, "broken", RuntimeError("compilation disabled by the test"))
    return request.param
