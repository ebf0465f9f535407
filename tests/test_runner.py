"""The runner's eager path for positional tensors: the same conversions as its general path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchkiln import runner as runner_mod
from torchkiln.recipe import Recipe
from torchkiln.runner import Runner


class Net(nn.Module):
    """Returns what it saw, so a test can read the conversions the runner made on the way in."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x, ids=None):
        y = self.conv(x)
        seen = (x.dtype, x.is_contiguous(memory_format=torch.channels_last))
        return {"y": y, "ids": ids if ids is not None else x.new_zeros(1, dtype=torch.long), "seen": seen}


CASES = {
    "float32": dict(recipe=Recipe(), upcast=False),
    "bf16 cast": dict(recipe=Recipe(dtype="bfloat16", dtype_mode="cast"), upcast=False),
    "bf16 autocast": dict(recipe=Recipe(dtype="bfloat16", dtype_mode="autocast"), upcast=False),
    "channels_last": dict(recipe=Recipe(memory_format="channels_last"), upcast=False),
    "float32 copy of a bf16 model": dict(recipe=Recipe(), upcast=True),
}


@pytest.mark.parametrize("case", CASES)
def test_positional_tensors_get_the_conversions_keyword_ones_get(case):
    """Keyword inputs take the general (pytree) path; positional plain tensors the eager one. Both
    must convert the same way: the dtype and layout the model saw, and the dtype it answers in."""
    c = CASES[case]
    torch.manual_seed(0)
    net = Net().eval()
    if c["recipe"].dtype_mode == "cast":
        net = net.to(torch.bfloat16)
    r = Runner(net, c["recipe"], upcast=c["upcast"])
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16 if c["upcast"] else torch.float32)
    ids = torch.tensor([[1, 2]])
    with torch.no_grad():
        pos, kw = r(x, ids), r(x=x, ids=ids)
    assert pos["seen"] == kw["seen"]
    assert pos["y"].dtype == kw["y"].dtype == x.dtype  # answers in the inputs' own dtype
    assert pos["ids"].dtype == torch.long and torch.equal(pos["ids"], ids)
    torch.testing.assert_close(pos["y"], kw["y"], rtol=0, atol=0)


def test_positional_plain_tensors_skip_the_pytree_walks(monkeypatch):
    """The point of the eager path: no pytree walk (18 of the runner's 22 us a call at one row)."""
    r = Runner(Net().eval(), Recipe(dtype="bfloat16", dtype_mode="autocast"))

    def walk(*a, **k):
        raise AssertionError("pytree walked")
    monkeypatch.setattr(runner_mod.inputs, "flatten", walk)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert r(x)["y"].dtype == torch.float32
        with pytest.raises(AssertionError, match="pytree walked"):
            r(x=x)  # keywords still take the general path


def test_a_parameter_input_takes_the_general_path(monkeypatch):
    """Only exact torch.Tensor inputs take the eager path; a subclass (nn.Parameter here) may carry
    its own dispatch, so it goes the way it always went."""
    r = Runner(Net().eval(), Recipe())
    calls = []
    real = runner_mod.inputs.flatten
    monkeypatch.setattr(runner_mod.inputs, "flatten", lambda obj: calls.append(1) or real(obj))
    with torch.no_grad():
        r(nn.Parameter(torch.randn(1, 3, 8, 8), requires_grad=False))
    assert calls == [1]
