"""tk.optimize leaves no trace of the runs that choose a candidate (torchkiln/pristine.py), and
notices weights replaced after it (torchkiln/watch.py). References are the same model
class run eagerly on a deep copy, call for call."""

import copy

import pytest
import torch
from torch import nn

import torchkiln as tk


class Counter(nn.Module):
    """Output scaled by how many times forward ran: a buffer and a plain attribute count."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.calls = 0

    def forward(self, x):
        self.count += 1
        self.calls += 1
        return self.lin(x) * self.count + self.calls


class Replacer(nn.Module):
    """Counts by replacing its buffer with a new tensor each call, not writing it in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count = self.count + 1
        return self.lin(x) * self.count


class Doubler(nn.Module):
    """Writes its input in place, as some preprocessing layers do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


@pytest.mark.parametrize("with_sample", [True, False])
def test_state_written_in_forward_advances_once_per_caller_call(with_sample):
    torch.manual_seed(0)
    model, x = Counter().eval(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    fast = tk.optimize(model, sample_input=x if with_sample else None, time_budget=0.2)
    assert int(model.count) == 0 and model.calls == 0  # optimize's own runs left nothing
    for n in range(1, 4):
        with torch.no_grad():
            torch.testing.assert_close(fast(x), twin(x), rtol=1e-5, atol=1e-5)
        assert int(model.count) == n and model.calls == n
    assert fast.kiln_report.active  # it served something, and its choice held over the calls


def test_inputs_written_in_place_are_the_callers_again_after_each_run():
    torch.manual_seed(1)
    model = Doubler().eval()
    x = torch.randn(4, 8)
    before = x.clone()
    fast = tk.optimize(model, sample_input=x, time_budget=0.2)
    assert torch.equal(x, before)  # the sample, untouched
    assert not [f for f in fast.kiln_report.fallbacks if "guard" in f.reason]  # every run saw the same input
    y, y_ref = before.clone(), before.clone()
    with torch.no_grad():
        torch.testing.assert_close(fast(y), model(y_ref), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, y_ref)  # the caller's call wrote it once, as eager does


def test_replaced_weights_are_noticed():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(4, 32)
    fast = tk.optimize(model, sample_input=x, time_budget=0.2, candidates="torchkiln")
    with torch.no_grad():
        model[0].weight.data = torch.randn_like(model[0].weight)  # new storage, same Parameter
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
        model[2].weight = nn.Parameter(torch.randn_like(model[2].weight))  # a new Parameter
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_hooks_keep_firing(dtype):
    """A feature-extraction hook runs once per call, with the served model's input to that layer;
    only candidates that run the model's own modules compete, and the report says why."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    seen = []
    model[5].register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach().float()))
    x = torch.randn(2, 3, 8, 8)
    with pytest.warns(UserWarning, match="forward hooks on 5"):
        fast = tk.optimize(model, dtype=dtype, sample_input=x, time_budget=0.2)
    seen.clear()
    with torch.no_grad():
        for _ in range(3):
            fast(x)
        ref = nn.Sequential(*model[:5])(x)
    assert len(seen) == 3
    torch.testing.assert_close(seen[-1], ref, rtol=5e-2 if dtype == torch.bfloat16 else 1e-5, atol=5e-2)
    assert any("forward hooks" in f.reason for f in fast.kiln_report.fallbacks)
    assert fast.kiln_report.active in {m.name for m in fast.kiln_report.candidates if m.kind in ("eager", "original")}


def test_the_returned_model_shows_the_originals_container_face():
    """Indexing, len and iteration of an nn.Sequential go to the original's modules; the model is
    in eval mode as the original is, and train()/eval() are the original's; a cast to the dtype it
    serves is a no-op, to another one a clear error."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=torch.randn(2, 8), time_budget=0.2)
    assert fast[0] is model[0] and len(fast) == 3 and list(fast) == list(model) and bool(fast)
    assert not fast.training
    assert fast.train() is fast and fast.training and model.training and copy.deepcopy(fast).training
    assert not fast.eval().training and not model.training and not copy.deepcopy(fast).training
    served = fast.kiln_report.dtype_served  # bfloat16 where the CPU has it natively, else float32
    same = {"bfloat16": fast.bfloat16, "float32": fast.float}[served]
    assert fast.to(getattr(torch, served)) is fast and same() is fast  # the served dtype, either way
    with pytest.raises(RuntimeError, match="casting it to torch.float16"):
        fast.to(torch.float16)
    with pytest.raises(RuntimeError, match="casting it to torch.float16"):
        fast.half()
    solo = tk.optimize(nn.Linear(4, 4).eval())
    assert bool(solo)
    with pytest.raises(TypeError):
        len(solo)


@pytest.mark.parametrize("with_sample", [True, False])
def test_state_kept_by_replacing_a_buffer_is_served_as_given(with_sample):
    """The selection's runs used to leave the replaced counter at 3-5 (found by version, the old tensor
    never changed), so every later output was off from eager's; a copy would never advance it."""
    torch.manual_seed(0)
    model, x = Replacer().eval(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    fast = tk.optimize(model, sample_input=x if with_sample else None, time_budget=0.2)
    assert int(model.count) == 0  # optimize's own runs left nothing
    for n in range(1, 4):
        with torch.no_grad():
            torch.testing.assert_close(fast(x), twin(x), rtol=1e-5, atol=1e-5)
        assert int(model.count) == n
    assert fast.kiln_report.active == "original model"
    assert any("replaces buffer(s) count" in f.reason for f in fast.kiln_report.fallbacks)


class Stasher(nn.Module):
    """Keeps its last attention-like map for inspection, and counts calls in a plain attribute."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        y = torch.relu(self.conv(x))
        self.last_map = y.mean(1).detach()
        self.calls += 1
        return self.head(y.mean((2, 3)))


class LazyCache(nn.Module):
    """Fills a cache on its first call and only reads it afterwards (as swin's shift_size is set once)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.arange(8.0)
        return self.lin(x) + self.table


def test_per_call_state_names_what_moves_at_every_call_only():
    from torchkiln.pristine import per_call_state
    for model, want in ((Counter().eval(), ["calls", "count"]), (Stasher().eval(), ["calls", "last_map"]),
                        (LazyCache().eval(), []), (nn.Linear(8, 8).eval(), [])):
        x = torch.randn(2, 3, 8, 8) if isinstance(model, Stasher) else torch.randn(2, 8)
        with torch.no_grad():
            assert per_call_state(model, lambda m=model, x=x: m(x)) == want


def test_state_kept_in_attributes_advances_as_eager_for_every_candidate():
    """Traced and compiled candidates run copies (or no Python at all): served, they left the stored map
    at optimize's sample and the counter still. Only candidates running the model's own modules compete."""
    torch.manual_seed(5)
    model = Stasher().eval()
    twin = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="changes calls, last_map at every call"):
        fast = tk.optimize(model, sample_input=torch.randn(2, 3, 16, 16), time_budget=0.2, candidates="torchkiln")
    assert model.calls == 0 and not hasattr(model, "last_map")  # optimize's own runs left nothing
    for _ in range(3):
        x = torch.randn(2, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), twin(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.last_map, twin.last_map, rtol=1e-5, atol=1e-5)
    assert model.calls == twin.calls == 3
    assert fast.kiln_report.active == "original model"  # candidates="torchkiln": no other runs the model's modules
    assert any("at every call" in f.reason for f in fast.kiln_report.fallbacks)


def test_state_set_once_leaves_every_candidate_in():
    torch.manual_seed(6)
    model = LazyCache().eval()
    x = torch.randn(4, 8)
    fast = tk.optimize(model, sample_input=x, time_budget=0.2, candidates="torchkiln")
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model.lin(x) + torch.arange(8.0), rtol=1e-5, atol=1e-5)
    assert fast.kiln_report.active != "original model"
    assert not any("at every call" in f.reason for f in fast.kiln_report.fallbacks)
