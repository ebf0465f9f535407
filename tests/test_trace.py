"""IPEX's documented inference flow run on tk.optimize's model: ``torch.jit.trace`` (by position, or by
keyword with ``example_kwarg_inputs``) then ``torch.jit.freeze``. It failed before ("Cannot insert a
Tensor that requires grad as a constant"; "'input_ids' is not in forward() method's arguments").
References: the same flow on a copy of the original."""

import copy
import inspect
import warnings

import pytest
import torch
from torch import nn

import torchkiln as tk


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4)).eval()


def traced_and_frozen(model, dtype, *args, **kwargs):
    """As IPEX's docs write it: under no_grad (and autocast for bf16), trace, freeze, run twice."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        if kwargs:
            t = torch.jit.trace(model, example_kwarg_inputs=kwargs, strict=False)
        else:
            t = torch.jit.trace(model, args)
        t = torch.jit.freeze(t)
        t(*args, **kwargs)
        return t(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trace_and_freeze_of_the_returned_model_is_the_originals(dtype):
    model, x = cnn(), torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(model, dtype=dtype, sample_input=x, time_budget=0.2)
    with pytest.warns(UserWarning, match="torch.jit.trace of the model tk.optimize returned") as seen:
        got = traced_and_frozen(fast, dtype, x)
    assert {w.filename for w in seen if "torchkiln" in str(w.message)} == {__file__}  # the user's line
    ref = traced_and_frozen(copy.deepcopy(model).requires_grad_(False), dtype, x)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(got.float(), model(x), rtol=5e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    assert all(p.requires_grad for p in model.parameters())  # the original is left as it was
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=5e-2, atol=5e-2)  # and the returned model still serves


def test_trace_by_keyword_of_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = {"input_ids": torch.randint(0, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(model, sample_input=ids, time_budget=0.2)
        got = traced_and_frozen(fast, torch.float32, **ids)
    assert list(inspect.signature(fast.forward).parameters) == list(inspect.signature(model.forward).parameters)
    with torch.no_grad():
        torch.testing.assert_close(got["last_hidden_state"], model(**ids).last_hidden_state, rtol=1e-5, atol=1e-5)


def test_a_copy_keeps_the_signature_and_calls_its_own_model():
    model, x = cnn(), torch.randn(2, 3, 16, 16)
    fast = tk.optimize(model, sample_input=x, time_budget=0.2)
    twin = copy.deepcopy(fast)
    assert inspect.signature(twin.forward) == inspect.signature(model.forward)
    with torch.no_grad():
        twin.kiln_original[5].bias.add_(1.0)  # the copy's own original, not fast's
        torch.testing.assert_close(twin(x), fast(x) + 1.0, rtol=1e-4, atol=1e-4)


def test_torch_compile_of_the_returned_model_runs_it_as_is(monkeypatch):
    """torch.compile(fast) traced into the wrapper (locks, checks; graph breaks) and ran 10% slower
    than fast on a 4-layer BERT; the wrapper is closed to it now: dynamo never traces its forward."""
    from torchkiln.optimize import KilnModule

    model, x = cnn(), torch.randn(2, 3, 16, 16)
    seen = []
    impl = KilnModule.forward
    monkeypatch.setattr(KilnModule, "forward", lambda self, *a, **k: seen.append(torch.compiler.is_compiling())
                        or impl(self, *a, **k))
    fast = tk.optimize(model, sample_input=x, time_budget=0.2)
    with torch.no_grad():
        want = fast(x)
        torch._dynamo.reset()
        seen.clear()
        got = torch.compile(fast)(x)
    assert seen == [False]  # run once, not traced
    torch.testing.assert_close(got, want)


def test_script_of_the_returned_model_scripts_the_original():
    """torch.jit.script(fast) raised NotSupportedError on the wrapper's ``*args`` forward, where scripting
    the user's model worked; it scripts the original now, and says so."""
    model, x = cnn(), torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(model, sample_input=x, time_budget=0.2)
    with pytest.warns(UserWarning, match="torch.jit.script of the model tk.optimize returned scripts the original"):
        scripted = torch.jit.script(fast)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)  # the returned model still serves
    assert isinstance(scripted, torch.jit.ScriptModule) and type(fast).__name__ == "KilnModule"
