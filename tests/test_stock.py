"""stock.py: the recipes a skilled user writes, as optimize() and bench build them."""

import gc

import torch
from torch import nn

from torchkiln import stock
from torchkiln.candidates import candidates
from torchkiln.recipe import Recipe


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)).eval()


def _first_weight(fn) -> torch.Tensor:
    """The first Linear weight a stock callable runs (eager or wrapped by torch.compile)."""
    mod = fn.fn
    mod = getattr(mod, "_orig_mod", mod)  # torch.compile's wrapper
    mod = getattr(mod, "model", mod)  # Fresh
    return next(mod.parameters())


def test_recipes_that_cast_share_one_copy_and_leave_the_original_alone():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cast = stock.SharedCast(model)
    dev = torch.device("cpu")
    eager, compiled = [r for r in stock.eager_recipes(torch.bfloat16) if r.how == "cast"] + \
        [r for r in stock.compile_recipes(dev, torch.bfloat16) if r.how == "cast"][:1]
    a = stock.build(eager, model, dev, cast=cast)
    b = stock.build(compiled, model, dev, cast=cast)
    wa, wb = _first_weight(a), _first_weight(b)
    assert wa.dtype == torch.bfloat16 and wa.data_ptr() == wb.data_ptr()  # one copy, not two
    assert next(model.parameters()).dtype == torch.float32
    x = torch.randn(3, 64)
    ref = model(x)
    with torch.no_grad():
        for fn in (a, b):
            out = fn(x)
            assert out.dtype == torch.float32  # cast back to the input's dtype
            torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)  # bf16's error on this model
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # Without a shared cast each build makes its own copy, as bench's peers do.
    c = stock.build(eager, model, dev)
    assert _first_weight(c).data_ptr() != wa.data_ptr()


def test_the_shared_copy_goes_with_the_last_recipe_and_is_made_again():
    model = _model()
    cast = stock.SharedCast(model)
    eager = stock.eager_recipes(torch.bfloat16)[0]
    a = stock.build(eager, model, torch.device("cpu"), cast=cast)
    dead = cast._copies[torch.bfloat16]
    assert dead() is a.fn
    del a
    gc.collect()
    assert dead() is None  # not kept alive by the cache
    b = stock.build(eager, model, torch.device("cpu"), cast=cast)
    assert b.fn.training is False and next(b.fn.parameters()).dtype == torch.bfloat16


def test_optimize_candidates_share_the_cast_copy():
    model = _model()
    recipe = Recipe(device="cpu", dtype="bfloat16", dtype_mode="cast", compile=False)
    cands = [c for c in candidates(model, recipe, None, False, "auto", []) if c.name == "eager bf16-cast"]
    assert len(cands) == 1
    first = cands[0].make()
    again = cands[0].make()  # a second build while the first lives: the same copy
    assert _first_weight(first).data_ptr() == _first_weight(again).data_ptr()


def test_live_weights_is_true_exactly_for_candidates_a_weight_change_reaches():
    """KilnModule skips its per-call weight check for candidates marked live_weights: the mark must hold
    for what each eager candidate really does (an in-place change, as an EMA update makes)."""
    model, x = _model(), torch.randn(4, 64)
    recipe = Recipe(device="cpu", dtype="bfloat16", dtype_mode="cast", compile=False)
    cands = {c.name: c for c in candidates(model, recipe, None, False, "auto", []) if c.kind in ("eager", "original")}
    assert {"eager bf16-cast", "eager bf16-autocast", "eager (as given, float32)", "original model"} <= set(cands)
    fns = {n: c.make() for n, c in cands.items()}
    with torch.no_grad():
        before = {n: f(x) for n, f in fns.items()}
        model[0].weight.mul_(3)
        for n, c in cands.items():
            assert (not torch.equal(fns[n](x), before[n])) == c.live_weights, n
    assert not cands["eager bf16-cast"].live_weights and cands["eager bf16-autocast"].live_weights


def test_the_model_as_given_is_called_with_nothing_around_it(monkeypatch):
    """A recipe that neither casts nor compiles with graphs calls the model straight: the input walk
    and context stack around it cost ~15 us a call, 4% of a one-row MLP served as given. A cast recipe
    still walks its inputs (to cast them, and the output back)."""
    model, x = _model(), torch.randn(2, 64)
    dev = torch.device("cpu")
    walks = []
    real = stock.inputs.flatten
    monkeypatch.setattr(stock.inputs, "flatten", lambda *a, **k: walks.append(1) or real(*a, **k))
    given = stock.build(stock.AS_GIVEN, model, dev)
    with torch.no_grad():
        assert torch.equal(given(x), model(x)) and walks == []
        cast = stock.build(stock.eager_recipes(torch.bfloat16)[0], model, dev)
        assert cast(x).dtype == torch.float32 and walks == [1]
