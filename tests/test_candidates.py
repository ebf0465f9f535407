"""What a torchkiln candidate does to each call's inputs before its compiled graph runs."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from torchkiln.candidates import KilnCall


def _call():
    return KilnCall(lambda **k: k, SimpleNamespace(recipe=SimpleNamespace(drop_all_ones_mask=True)), False)


def test_an_all_ones_mask_is_dropped_and_a_padded_one_kept():
    c, ids = _call(), torch.ones(2, 5, dtype=torch.long)
    assert c._drop_mask({"input_ids": ids, "attention_mask": torch.ones(2, 5)})["attention_mask"] is None
    padded = torch.ones(2, 5)
    padded[1, 3:] = 0
    assert c._drop_mask({"attention_mask": padded})["attention_mask"] is padded
    four_d = torch.ones(2, 1, 5, 5)
    assert c._drop_mask({"attention_mask": four_d})["attention_mask"] is four_d  # already the model's own form


def test_the_same_unchanged_mask_is_read_once_and_a_changed_one_again(monkeypatch):
    c, m = _call(), torch.ones(1, 8)
    reads = []
    real = torch.Tensor.all
    monkeypatch.setattr(torch.Tensor, "all", lambda self, *a, **k: reads.append(1) or real(self, *a, **k))
    for _ in range(3):
        assert c._drop_mask({"attention_mask": m})["attention_mask"] is None
    assert len(reads) == 1
    m[0, -1] = 0  # written in place: its version moves, so it is read again
    assert c._drop_mask({"attention_mask": m})["attention_mask"] is m
    other = torch.zeros(1, 8)
    assert c._drop_mask({"attention_mask": other})["attention_mask"] is other
    assert len(reads) == 3


class Tagger(torch.nn.Module):
    """Token ids in, scores out: no floating input to take the output dtype from."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(torch.nn.functional.gelu(self.emb(ids)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_candidate_answers_token_ids_in_the_models_own_dtype(dtype):
    """With no floating input, the casting candidates answered in float32 (their output cast assumed a
    float32 model): an fp16 BERT served in fp16 returned float32 where eager returns float16."""
    import torchkiln as tk

    torch.manual_seed(0)
    model = Tagger().to(dtype).eval()
    ids = torch.randint(0, 50, (3, 7))
    fast = tk.optimize(model, sample_input=ids, time_budget=0.1)
    with torch.no_grad():
        want = model(ids).dtype
        got = {c.name: c.make()(ids).dtype for c in fast._cands}
        assert fast(ids).dtype == want
    assert want == dtype and set(got.values()) == {want}, got


@pytest.mark.parametrize("machine,own,device,inplace,want", [
    ("X86_BF16", torch.float16, "cpu", False, True),    # no AVX512_FP16: fp16 is emulated
    ("X86_BF16", torch.bfloat16, "cpu", False, False),  # native bf16: nothing to gain
    ("X86_NO_BF16", torch.bfloat16, "cpu", False, True),
    ("X86_NO_BF16", torch.float32, "cpu", False, False),
    ("X86_BF16", torch.float16, "cpu", True, False),    # inplace: no copy to make
    ("X86_BF16", torch.float16, "cuda:0", False, False),
])
def test_a_float32_copy_competes_only_for_a_half_model_the_cpu_emulates(monkeypatch, machine, own, device, inplace,
                                                                         want):
    from plan import fakes

    from torchkiln import hardware
    from torchkiln.candidates import upcast_wins
    from torchkiln.recipe import Recipe

    monkeypatch.setattr(hardware, "detect", lambda: getattr(fakes, machine))
    recipe = Recipe(device=device, dtype=str(own).removeprefix("torch."), dtype_mode="none")
    assert upcast_wins(torch.nn.Linear(4, 4).to(own), recipe, inplace) is want


def test_the_float32_copy_of_a_half_model_answers_in_its_dtype_closer_to_float32(monkeypatch):
    """fp16 bert-base on a CPU without AVX512_FP16: 406 ms a call as given, 55 ms served from torchkiln's
    float32 copy (2-core Zen 5). The copy's candidates take fp16 inputs and answer in fp16, nearer the
    float32 truth than fp16 eager; the caller's fp16 weights are untouched."""
    import torchkiln as tk

    opt_mod = __import__("importlib").import_module("torchkiln.optimize")
    monkeypatch.setattr(opt_mod, "upcast_wins", lambda *a: True)  # whatever this CPU has natively
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).half().eval()
    before = [p.clone() for p in model.parameters()]
    x = torch.randn(16, 64).half()
    fast = tk.optimize(model, sample_input=x, time_budget=0.2)
    ups = [c for c in fast._cands if c.tier == 0 and c.kind == "torchkiln" and c.dtype == "float32"]
    assert ups and not [c for c in fast._cands if c.tier == 1]
    with torch.no_grad():
        truth = copy.deepcopy(model).float()(x.float())
        half_err = (model(x).float() - truth).abs().max()
        for c in ups:
            out = c.make()(x)
            assert out.dtype == torch.float16
            assert (out.float() - truth).abs().max() <= half_err
        assert fast(x).dtype == torch.float16
    assert all(p.dtype == torch.float16 and torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_the_float32_copy_is_made_only_of_a_plain_half_model_not_in_place():
    from torchkiln.recipe import Recipe
    from torchkiln.runner import upcasts

    fp32 = Recipe(device="cpu", dtype="float32")
    half = torch.nn.Linear(4, 4).half()
    assert upcasts(half, fp32, inplace=False)
    assert not upcasts(half, fp32, inplace=True)  # the caller's own model: never cast up behind them
    assert not upcasts(torch.nn.Linear(4, 4), fp32, inplace=False)  # float32 already
    assert not upcasts(half, Recipe(device="cpu", dtype="float16", dtype_mode="cast"), inplace=False)
    quantized = torch.nn.Linear(4, 4).half()
    quantized.kiln_quant = object()  # tk.quantize's mark: its weights would be dequantized by a cast
    assert not upcasts(quantized, fp32, inplace=False)


def test_a_float64_model_is_never_computed_in_float32():
    """The float32 copy is for half-precision models only: a float64 model went through it too (its
    outputs cast back to float64, their digits float32's)."""
    import torchkiln as tk

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).double().eval()
    x = torch.randn(8, 32, dtype=torch.float64)
    fast = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0.1)
    with torch.no_grad():
        want = model(x)
        for c in fast._cands:
            torch.testing.assert_close(c.make()(x), want, rtol=1e-12, atol=1e-12)  # float32: ~1e-7


def test_a_cuda_graph_recipe_adds_a_captured_candidate_sharing_the_plain_ones_compile(monkeypatch):
    """captured.py replays the no-graph compiled model from hand-captured graphs: one compile for both
    candidates, built here without a GPU (nothing runs until a call)."""
    from torchkiln import candidates as cand_mod
    from torchkiln.captured import Captured
    from torchkiln.recipe import Recipe

    made = []

    def fake_compile(model, options, **kw):
        made.append(dict(options))
        return torch.nn.Identity()
    monkeypatch.setattr(cand_mod, "compile_model", fake_compile)
    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(cand_mod.KilnBuild, "runner", lambda self: model)  # (the real one moves it to the GPU)
    for graphs in (True, False):
        recipe = Recipe(device="cuda:0", dtype="float32", dtype_mode="none", compile=True, cuda_graphs=graphs,
                        compile_options=(("freezing", True),))
        cands = {c.name: c for c in cand_mod.candidates(model, recipe, None, False, "torchkiln", [])}
        if not graphs:  # no sample fixes the shapes: no graph candidate of either kind
            assert not [n for n in cands if "CUDA graphs" in n]
            continue
        mine = cands["torchkiln compiled (float32) + captured CUDA graphs"]
        plain = cands["torchkiln compiled (float32)"]
        assert mine.cuda_graphs and mine.copies and not plain.copies
        assert not cands["torchkiln compiled (float32) + CUDA graphs"].copies  # the trees' outputs: copied by _serve
        made.clear()
        a, b = mine.make(), plain.make()
        assert isinstance(a.fn, Captured) and a.fn.fn is b.fn and not a.cuda_graphs
        assert made == [{"freezing": True, "triton.cudagraphs": False}]  # one compile, without the trees
        # the trees come after the captured candidate, and are skipped once it holds a graph
        names = list(cands)
        trees = cands["torchkiln compiled (float32) + CUDA graphs"]
        assert names.index(trees.name) > names.index(mine.name) and mine.skip is None
        assert trees.skip({"plain": b, mine.name: a}) is None  # nothing captured yet
        a.fn._graphs[("a signature",)] = None  # one it could not capture
        assert trees.skip({mine.name: a}) is None
        a.fn._graphs[("another",)] = object()
        assert "captured CUDA graphs serve" in trees.skip({mine.name: a})
        assert trees.skip({"plain": b}) is None  # the captured candidate did not pass
        monkeypatch.setattr(cand_mod, "TREES_BESIDE_CAPTURED", True)
        assert trees.skip({mine.name: a}) is None
        monkeypatch.setattr(cand_mod, "TREES_BESIDE_CAPTURED", False)
