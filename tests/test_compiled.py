"""torchkiln.compiled.Unguarded: guards skipped only on calls like the first.

Each test reads a Python float the compiled function closes over: dynamo bakes it into the
graph and guards on it, so after a change a guarded call recompiles (the new value) and a call
that skipped its guards runs the old graph (the old value). That makes skipping observable."""

import contextlib

import pytest
import torch

from torchkiln.compiled import Unguarded
from torchkiln.llm.model import fresh


def _fn(box):
    # a code object of its own per test: dynamo's cache (and its recompile limit) is per code object
    return torch.compile(fresh(lambda x: x * box["k"]), backend="eager", fullgraph=True, dynamic=False)


def test_a_call_like_the_first_skips_the_guards():
    box = {"k": 2.0}
    u = Unguarded(_fn(box), "cpu")
    x = torch.ones(3)
    torch.testing.assert_close(u(x), x * 2)
    box["k"] = 3.0
    torch.testing.assert_close(u(x), x * 2)  # skipped: the compiled graph for k=2 ran
    torch.testing.assert_close(u.fn(x), x * 3)  # the guarded call sees the change


def test_other_shapes_strides_or_dtypes_are_guarded():
    box = {"k": 2.0}
    u = Unguarded(_fn(box), "cpu")
    u(torch.ones(3))
    box["k"] = 3.0
    torch.testing.assert_close(u(torch.ones(4)), torch.full((4,), 3.0))
    torch.testing.assert_close(u(torch.ones(3, dtype=torch.float64)), torch.full((3,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(u(torch.ones(6)[::2]), torch.full((3,), 3.0))


@pytest.mark.parametrize("context", ["grad", "autocast", "inference_mode"])
def test_changed_global_state_is_guarded(context):
    box = {"k": 2}
    u = Unguarded(_fn(box), "cpu")
    x = torch.ones(3)
    with torch.no_grad():
        u(x)
    box["k"] = 3
    ctx = {"grad": contextlib.nullcontext(), "autocast": torch.autocast("cpu", dtype=torch.bfloat16),
           "inference_mode": torch.inference_mode()}[context]
    with torch.no_grad() if context != "grad" else contextlib.nullcontext(), ctx:
        assert not u.same((x,))
        torch.testing.assert_close(u(x), x * 3)


def test_a_stance_of_the_users_is_kept():
    box = {"k": 2.0}
    u = Unguarded(_fn(box), "cpu")
    x = torch.ones(3)
    u(x)
    box["k"] = 3.0
    with torch.compiler.set_stance("force_eager"):
        torch.testing.assert_close(u(x), x * 3)  # eager, as the user asked
        assert not u.same((x,))
    assert u.same((x,))


def test_a_failed_first_call_records_nothing():
    def boom(x):
        raise RuntimeError("compile failed")

    u = Unguarded(boom, "cpu")
    try:
        u(torch.ones(1))
    except RuntimeError:
        pass
    assert u.signature is None and not u.same((torch.ones(1),))
