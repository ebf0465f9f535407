import pytest
import torch

from torchkiln.optim import kernels


@pytest.fixture(autouse=True, params=["compiled", "foreach"])
def form(request, monkeypatch):
    """Every optimizer test runs in both forms: the compiled per-tensor kernels and the
    _foreach form they fall back to when compilation is unavailable."""
    if request.param == "foreach":
        monkeypatch.setitem(kernels._state, "broken", RuntimeError("compilation disabled by the test"))
    return request.param


@pytest.fixture(autouse=True)
def _one_thread():
    # Tensors of a few hundred elements: a second intra-op thread only adds OpenMP syncs, which cost
    # seconds per test when another process is using the cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
