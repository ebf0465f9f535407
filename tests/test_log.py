"""warn_once: once per key, and per-object keys die with their object."""

import gc
import warnings

from torch import nn

from torchkiln._log import warn_once


def test_a_new_object_at_a_reused_address_still_warns():
    """Keyed by id(), a model created after another was freed could reuse its address and never
    warn (CI saw exactly this between two parametrisations of one test)."""
    seen = []
    for _ in range(3):
        m = nn.Linear(2, 2)
        seen.append(id(m))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            warn_once("k", "first", owner=m)
            warn_once("k", "second", owner=m)
        assert [str(x.message) for x in w] == ["first"]
        del m
        gc.collect()


def test_without_an_owner_a_key_warns_once_per_process():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        warn_once("test-log-process-key", "a")
        warn_once("test-log-process-key", "b")
    assert [str(x.message) for x in w] == ["a"]


def test_an_owner_that_cannot_be_weakly_referenced_falls_back_to_the_process_key():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        warn_once("test-log-int-owner", "a", owner=7)
        warn_once("test-log-int-owner", "b", owner=7)
    assert [str(x.message) for x in w] == ["a"]
