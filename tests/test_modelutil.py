"""modelutil.first_line: what reports and warnings say about an exception."""

import torch

from torchkiln.modelutil import first_line


def test_a_line_that_only_introduces_the_cause_is_followed_by_it():
    """A failed compile reported "BackendCompilerFailed: backend='inductor' raised:" with the cause cut off."""
    e = torch._dynamo.exc.BackendCompilerFailed("inductor", DeprecationWarning("x is deprecated"), None)
    assert first_line(e).endswith("raised: DeprecationWarning: x is deprecated")


def test_a_plain_message_keeps_its_first_line_and_an_empty_one_its_repr():
    assert first_line(ValueError("bad shape: (2, 3)\nmore detail")) == "bad shape: (2, 3)"
    assert first_line(ValueError("")) == "ValueError('')"
    assert len(first_line(RuntimeError("x" * 1000))) == 300
