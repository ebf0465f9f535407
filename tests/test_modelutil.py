"""modelutil.first_line: what reports and warnings say about an exception."""

from torchkiln.modelutil import first_line


def test_a_line_that_only_introduces_the_cause_is_followed_by_it():
    """A failed compile reported "BackendCompilerFailed: backend='inductor' raised:" with the cause cut off."""
    # dynamo's message form (its constructor's arguments differ across torch versions)
    e = RuntimeError("backend='inductor' raised:\nDeprecationWarning: x is deprecated\n\nmore")
    assert first_line(e) == "backend='inductor' raised: DeprecationWarning: x is deprecated"


def test_a_plain_message_keeps_its_first_line_and_an_empty_one_its_repr():
    assert first_line(ValueError("bad shape: (2, 3)\nmore detail")) == "bad shape: (2, 3)"
    assert first_line(ValueError("")) == "ValueError('')"
    assert len(first_line(RuntimeError("x" * 1000))) == 300
