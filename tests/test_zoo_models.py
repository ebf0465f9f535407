"""Every zoo model through optimize() at fp32 and bf16: compiles to one graph and
matches fp32 eager. About 2 minutes on 2 cores, so marked slow: pytest -m slow."""

import pytest
import torch

import torchkiln as tk
from torchkiln import zoo

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["resnet50", "bert-base", "vit-base", "gpt2", "llama-small"])
def test_zoo_model_compiles_and_matches_eager(name, dtype):
    if dtype == "bfloat16" and not tk.detect().cpu.bf16_native:
        pytest.skip("no native bf16 on this CPU")
    model, x = zoo.load(name, batch=1, seq=64)
    o = tk.optimize(model, dtype=dtype, sample_input=x)
    rep = o.kiln_report
    by = {c.name: c for c in rep.candidates}
    # torchkiln's recipe compiles to one graph and passes the guard, whatever ends up served
    assert by[f"torchkiln compiled ({dtype})"].status in ("served", "passed"), str(rep)
    assert rep.fallbacks == [] and rep.guard["ok"], str(rep)
    # never slower: nothing that was timed beats what serves
    timed = [c.median_ms for c in rep.candidates if c.median_ms is not None]
    assert by[rep.active].median_ms == min(timed), str(rep)
    out = o(**x) if isinstance(x, dict) else o(x)
    ref = model(**x) if isinstance(x, dict) else model(x)
    first = lambda t: t if torch.is_tensor(t) else t[0]  # noqa: E731
    assert first(out).shape == first(ref).shape
