"""Calls only the original's own modules answer right (torchkiln/optimize.py ``_own_call``,
torchkiln/hookwatch.py): inputs that require grad, and forward hooks that changed after optimize.
References are the same model run eagerly (a deep copy, or the original itself), call for call."""

import copy
import warnings

import needs
import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.hookwatch import HookWatch
from torchkiln.optimize import KilnModule


def features():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()


@pytest.fixture
def served():
    """A feature network served by torchkiln's own (traced/compiled) form, which holds its own weights."""
    model, x = features(), torch.randn(2, 3, 16, 16)
    fast = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0.2)
    with torch.no_grad():
        fast(x)
    assert not fast._served.live_weights, fast.kiln_report.active  # else these tests test nothing
    return model, fast, x


def counting(monkeypatch):
    routed = []
    own = KilnModule._own_call
    monkeypatch.setattr(KilnModule, "_own_call", lambda self, a, k, key: routed.append(key) or own(self, a, k, key))
    return routed


def generator_grad(net, gen, x):
    """A perceptual loss: the frozen network's output on the generator's output is part of the loss."""
    gen.zero_grad()
    out = gen(x)
    ((out - x).pow(2).mean() + net(out).pow(2).mean()).backward()
    return gen.weight.grad.clone()


def test_gradients_flow_through_to_inputs_that_require_them(served):
    """The generator's gradient through the optimized network equals the one through the original
    (it was silently missing the network's term: rel 1.7e-2); warned once, and in the report."""
    model, fast, x = served
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(1)
    gen = nn.Conv2d(3, 3, 3, padding=1)
    ref = generator_grad(copy.deepcopy(model), gen, x)
    with pytest.warns(UserWarning, match="inputs require grad") as seen:
        got = generator_grad(fast, gen, x)
    assert [w.filename for w in seen if "require grad" in str(w.message)] == [__file__]  # the user's line
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        generator_grad(fast, gen, x)
    assert [f.to for f in fast.kiln_report.fallbacks if "require grad" in f.step] == [
        "the original model (eager, with autograd)"]


def test_inputs_without_grad_stay_on_the_fast_path(served, monkeypatch):
    """Grad mode on (the default) with plain inputs, or inputs that require grad under no_grad: served."""
    model, fast, x = served
    routed = counting(monkeypatch)
    out = fast(x)
    with torch.no_grad():
        out2 = fast(x.clone().requires_grad_(True))
    assert routed == [] and out.requires_grad  # as eager's; a backward recomputes with the original
    assert not out2.requires_grad
    torch.testing.assert_close(out2, out.detach())
    with pytest.warns(UserWarning, match="inputs require grad"):
        assert fast(x.clone().requires_grad_(True)).requires_grad
    assert routed == ["grad"]


def test_a_tensor_in_a_container_that_requires_grad_is_seen():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, xs):
            return self.lin(xs[0]) + xs[1]

    model = Pair().eval()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    fast = tk.optimize(model, sample_input=([a, b],), time_budget=0.2)
    b.requires_grad_(True)
    with pytest.warns(UserWarning, match="inputs require grad"):
        out = fast([a, b])
    out.sum().backward()
    torch.testing.assert_close(b.grad, torch.ones_like(b))


def test_a_hook_registered_after_optimize_runs_and_shapes_the_output(served, monkeypatch):
    """A pre-hook that edits a layer's input changes the output as it does on the original; a
    feature hook fires once per call; after both are removed, calls are served again."""
    model, fast, x = served
    routed = counting(monkeypatch)
    with torch.no_grad():
        plain = model(x)  # before the hooks
    seen = []
    h1 = fast[1].register_forward_hook(lambda m, i, o: seen.append(o))  # on the original's module
    h2 = model[2].register_forward_pre_hook(lambda m, i: (i[0] * 0.5,))
    with pytest.warns(UserWarning, match="forward hooks differ"), torch.no_grad():
        out = fast(x)
        ref = model(x)  # hooks included
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out - plain).abs().max() > 1e-2  # the pre-hook matters
    assert len(seen) == 2 and routed == ["hooks"]  # the reference call fired it too
    h1.remove()
    h2.remove()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), plain, rtol=1e-4, atol=1e-4)
    assert routed == ["hooks"] and any("hooks" in f.step for f in fast.kiln_report.fallbacks)


@needs.bf16_cpu
def test_a_hook_there_at_optimize_and_removed_after_stops_firing():
    """A cast copy made at optimize carries the hooks then present; once the user removes one, it
    must not fire from the copy."""
    model, x = features(), torch.randn(2, 3, 16, 16)
    seen = []
    handle = model[1].register_forward_hook(lambda m, i, o: seen.append(1))
    with pytest.warns(UserWarning, match="forward hooks on 1"):
        fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=x, time_budget=0.2)
    fast._reset(choice="eager bf16-cast")  # whichever the clock chose: serve the copy
    with torch.no_grad():
        fast(x)
        assert fast.kiln_report.active == "eager bf16-cast" and not fast._served.live_weights
        assert len(seen) >= 1  # the copy's hook, while the original has it
        seen.clear()
        handle.remove()
        fast(x)
        fast(x)
    assert seen == []


def test_hookwatch_answers_for_this_models_hooks_only():
    model, other = features(), nn.Linear(2, 2)
    w = HookWatch(model)
    assert not w.changed()  # nothing remembered yet
    w.remember()
    h = other.register_forward_hook(lambda *a: None)  # another model's: the counter moves, the answer doesn't
    assert not w.changed()
    h2 = model[0].register_forward_pre_hook(lambda *a: None)
    assert w.changed()
    h2.remove()
    assert not w.changed()
    g = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)  # global: runs on every module
    try:
        assert w.changed()
    finally:
        g.remove()
    assert not w.changed()
    h.remove()


def test_hookwatch_sees_a_hook_swapped_for_another():
    """Removing one hook and adding another keeps the count but not the hooks."""
    model = features()
    h = model[0].register_forward_hook(lambda *a: None)
    w = HookWatch(model)
    w.remember()
    h.remove()
    h = model[0].register_forward_hook(lambda *a: None)
    assert w.changed()
    h.remove()


def _capture_hook(module, args, output):
    """Stands for transformers' output-capture hook (transformers/utils/output_capturing.py, 5.x): inert
    unless the running call asked for hidden states. The real one is tested in test_hf_pipelines.py."""


_capture_hook.__module__ = "transformers.utils.output_capturing"


def test_transformers_output_capture_hooks_neither_restrict_candidates_nor_count_as_a_change():
    from torchkiln.modelutil import hooked

    model = features()
    w = HookWatch(model)
    w.remember()
    h = model[0].register_forward_hook(_capture_hook)  # installed by a call that asked for hidden states
    assert hooked(model) == [] and not w.changed()
    h2 = model[2].register_forward_hook(lambda *a: None)  # a user's hook beside it still counts
    assert hooked(model) == ["2"] and w.changed()
    h2.remove()
    assert not w.changed()
    h.remove()


def test_a_submodule_put_in_training_mode_runs_the_original_then_back_to_served(monkeypatch):
    """Monte Carlo dropout: with a dropout layer put in training mode after optimize, each call draws
    its mask as eager does (the rebuilt form ran it in eval mode: deterministic, silently); back in
    eval mode, the form built before serves again, with no rebuild."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4)).eval()
    x = torch.randn(8, 32)
    fast = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0.2)
    with torch.no_grad():
        fast(x)
        served = fast.kiln_report.active
        resets = []
        monkeypatch.setattr(KilnModule, "_reset", lambda self, choice: resets.append(choice))
        model[2].train()
        with pytest.warns(UserWarning, match="a submodule of it is in training mode"):
            torch.manual_seed(5)
            a = fast(x)
        torch.manual_seed(5)
        ref = model(x)
        b = fast(x)
        torch.testing.assert_close(a, ref)
        assert (a - b).abs().max() > 1e-3  # a new mask each call
        model[2].eval()
        torch.testing.assert_close(fast(x), fast(x))
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    assert resets == [] and fast.kiln_report.active == served and fast._own is None


class Head(nn.Module):
    """A model being fine-tuned around a backbone: its .train()/.eval() reach the backbone."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.backbone(x))


def test_a_parents_train_puts_the_returned_model_in_training_mode_and_eval_brings_the_fast_form_back(monkeypatch):
    """A parent model's .train() (Lightning and HF Trainer call it every epoch) raised on the returned
    model, where eager trains: now its calls run the original in training mode, dropout masks and the
    parameters' gradients as eager's (a deep copy run the same way), and .eval() serves the form built
    before, with no rebuild."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4)).eval()
    twin = copy.deepcopy(backbone)
    x = torch.randn(8, 32)
    fast = tk.optimize(backbone, sample_input=x, candidates="torchkiln", time_budget=0.2)
    served = fast.kiln_report.active
    model, ref = Head(fast), Head(twin)
    ref.head.load_state_dict(model.head.state_dict())
    resets = []
    monkeypatch.setattr(KilnModule, "_reset", lambda self, choice: resets.append(choice))
    assert model.train() is model and fast.training and backbone.training and backbone[2].training
    with pytest.warns(UserWarning, match="the original or a submodule of it is in training mode"):
        torch.manual_seed(5)
        out = model(x)
    torch.manual_seed(5)
    want = ref.train()(x)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    model.eval()
    assert not fast.training and not any(m.training for m in backbone.modules())
    with torch.no_grad():
        torch.testing.assert_close(fast(x), twin.eval()(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast(x), fast(x))  # dropout off again
    assert resets == [] and fast.kiln_report.active == served and fast._own is None


def test_the_returned_model_called_first_in_training_mode_runs_the_original_then_sets_up_in_eval():
    """No sample_input and a first call in training mode: the original answers (nothing is built for a
    model in a mode it does not serve); the first call in eval mode sets up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 16)
    fast = tk.optimize(model, candidates="torchkiln", time_budget=0.2).train()
    with pytest.warns(UserWarning, match="training mode"), torch.no_grad():
        torch.manual_seed(1)
        a = fast(x)
        torch.manual_seed(1)
        torch.testing.assert_close(a, model(x))
    assert fast._fn is None
    with torch.no_grad():
        fast.eval()
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    assert fast._fn is not None and fast.kiln_report.active != "pending first call"


def test_calls_under_torch_func_transforms_run_the_original(served):
    """vmap of the returned model raised ("data-dependent control flow": the guard's checks on batched
    tensors); grad and jacrev need the model's own operations. Each now matches the same transform of
    the original (a deep copy), and plain calls stay on the served form."""
    model, fast, x = served
    twin = copy.deepcopy(model)
    active = fast.kiln_report.active
    with pytest.warns(UserWarning, match="torch.func transform"):
        got = torch.vmap(fast)(x.unsqueeze(1))
    torch.testing.assert_close(got, torch.vmap(twin)(x.unsqueeze(1)))
    torch.testing.assert_close(torch.func.grad(lambda z: fast(z).square().sum())(x),
                               torch.func.grad(lambda z: twin(z).square().sum())(x))
    torch.testing.assert_close(torch.func.jacrev(fast)(x[:1]), torch.func.jacrev(twin)(x[:1]))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), twin(x), rtol=1e-4, atol=1e-5)
    assert fast.kiln_report.active == active and not fast._served.live_weights


def autocast_bf16(net):
    def run(z):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return net(z).float()
    return run


@needs.bf16_cpu
@pytest.mark.parametrize("auto_ms,auto_status,expect", [(1.0, "passed", "autocast"), (20.0, "passed", "float32"),
                                                        (1.0, "failed", "float32")],
                         ids=["autocast-faster", "autocast-slower", "autocast-failed-guard"])
def test_grad_calls_run_the_requested_precision_only_where_it_passed_and_was_faster(auto_ms, auto_status, expect):
    """With dtype=bf16, calls that need autograd run the original under bf16 autocast (what a user's
    AMP would) only if that candidate passed the guard and timed faster than the float32 model as
    given (the measurements are set here, so the clock does not pick the case); else the original in
    float32. The generator's gradient equals that reference's exactly."""
    model, x = features(), torch.randn(2, 3, 16, 16)
    for p in model.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (which candidate serves does not matter here)
        fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=x, time_budget=0.2)
        with torch.no_grad():
            fast(x)
    by = {m.name: m for m in fast.kiln_report.candidates}
    auto, fp32 = by["eager bf16-autocast"], by["eager (as given, float32)"]
    auto.median_ms, auto.status, fp32.median_ms, fp32.status = auto_ms, auto_status, 10.0, "passed"
    torch.manual_seed(1)
    gen = nn.Conv2d(3, 3, 3, padding=1)
    ref = generator_grad(autocast_bf16(model) if expect == "autocast" else model, gen, x)
    with pytest.warns(UserWarning, match="autocast" if expect == "autocast" else r"original model \(eager"):
        got = generator_grad(fast, gen, x)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    other = generator_grad(model if expect == "autocast" else autocast_bf16(model), gen, x)
    assert (other - ref).abs().max() > 0  # the two references differ: the test tells them apart


def test_functional_call_runs_the_original_for_that_call_with_gradients(served):
    """torch.func.functional_call swaps tensors into the parameter slots for one call. The served form
    was rebuilt for them (and again when they were swapped back), and under grad mode its output had
    no grad_fn: backward raised where eager works. Reference: functional_call on the model itself."""
    from torch.func import functional_call

    model, fast, x = served
    fn = fast._fn
    params = {k: v.detach() * 1.5 for k, v in model.named_parameters()}
    ours = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    with pytest.warns(UserWarning, match="functional_call"):
        out = functional_call(fast, ours, (x,))
    functional_call(model, ref, (x,)).square().sum().backward()
    out.square().sum().backward()
    for k in params:
        torch.testing.assert_close(ours[k].grad, ref[k].grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(functional_call(fast, params, (x,)), functional_call(model, params, (x,)))
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)  # the originals are back
    assert fast._fn is fn  # nothing was rebuilt, for the swap or the swap back
    assert any("functional_call" in f.step for f in fast.kiln_report.fallbacks)


class TwoHeads(nn.Module):
    """Outputs of several kinds: two float heads and the predicted ids (integer)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.a, self.b = nn.Linear(32, 4), nn.Linear(32, 2)

    def forward(self, x):
        h = self.body(x)
        logits = self.a(h)
        return {"logits": logits, "score": self.b(h), "ids": logits.argmax(-1)}


def test_backward_through_a_call_made_with_grad_on_gives_eagers_parameter_gradients():
    """Called without torch.no_grad(), eager's outputs reach the parameters and loss.backward() fills
    their .grad; the served outputs had no grad_fn and backward raised "element 0 of tensors does not
    require grad" (the thirtieth session's probes). Reference: a deep copy, run eagerly."""
    torch.manual_seed(0)
    model, x = TwoHeads().eval(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    fast = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0.2)
    with torch.no_grad():
        served = fast(x)
    assert not fast._served.live_weights, fast.kiln_report.active
    assert not served["logits"].requires_grad
    out = fast(x)  # grad mode on, inputs need no grad: the served form answers
    torch.testing.assert_close(out["logits"], served["logits"])
    assert out["ids"].dtype == torch.int64 and not out["ids"].requires_grad
    (out["logits"].square().sum() + 3 * out["score"].sum()).backward()
    want = ref(x)
    (want["logits"].square().sum() + 3 * want["score"].sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    model.zero_grad()
    fast(x)["score"].sum().backward()  # one output only: the other's gradient is None
    ref.zero_grad()
    ref(x)["score"].sum().backward()
    torch.testing.assert_close(model.b.weight.grad, ref.b.weight.grad, rtol=1e-4, atol=1e-5)
    assert model.a.weight.grad is None and ref.a.weight.grad is None  # as eager: unused, not zero (optimizers differ)


def test_outputs_need_no_grad_where_eagers_would_not():
    torch.manual_seed(0)
    model, x = TwoHeads().eval(), torch.randn(8, 16)
    fast = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0.2)
    with torch.no_grad():
        assert not fast(x)["logits"].requires_grad
    model.requires_grad_(False)
    assert not fast(x)["logits"].requires_grad


class Counting(TwoHeads):
    """Keeps a call counter, per-call state the backward's rerun must not advance."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_the_backward_rerun_leaves_the_models_state_as_eager_would():
    torch.manual_seed(0)
    model, x = Counting().eval(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # per-call state: warned once, served by a candidate running the model
        fast = tk.optimize(model, sample_input=x, time_budget=0.2)
    before = model.calls
    fast(x)["logits"].sum().backward()
    ref(x)["logits"].sum().backward()
    assert model.calls == before + 1  # the user's call; not the rerun
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@needs.bf16_cpu
def test_calls_under_autocast_at_the_optimized_dtype_are_served_with_it_off_inside(monkeypatch):
    """IPEX's bf16 inference recipe (optimize at bf16, call under torch.cpu.amp.autocast()): the served
    form runs with the caller's autocast off (it computes at that precision already), so torch.compile
    does not recompile it unverified; the answer is the one served outside autocast."""
    model, x = features(), torch.randn(2, 3, 16, 16)
    fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=x, candidates="torchkiln", time_budget=0.2)
    with torch.no_grad():
        outside = fast(x)
        served, seen = fast._fn, []
        object.__setattr__(fast, "_fn", lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or served(*a, **k))
        routed = counting(monkeypatch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = fast(x)
        assert torch.is_autocast_enabled("cpu") is False  # the caller's state, restored
    assert seen == [False] and routed == []
    assert torch.equal(inside, outside)


def test_calls_under_autocast_at_another_dtype_run_the_original_under_it(monkeypatch):
    """Optimized at float32, called under bf16 autocast: eager's answer under that autocast (the original
    runs it), said once in the report, where the served float32 form would silently ignore autocast."""
    model, x = features(), torch.randn(2, 3, 16, 16)
    fast = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0.2)
    routed = counting(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got, want = fast(x), model(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert routed == ["autocast"]
    assert any("autocast" in f.step for f in fast.kiln_report.fallbacks)
    assert any("dtype=<autocast's dtype>" in str(m.message) for m in w)


def test_calls_under_inference_mode_reuse_the_graph_compiled_under_no_grad():
    """Selection runs under no_grad; serving stacks call under torch.inference_mode(), whose dispatch
    keys failed dynamo's input guards: the served graph was compiled again at the first such call
    (bert-base bf16: 14 s). Inputs made inside inference mode included."""
    from torch._dynamo.utils import counters

    model, x = features(), torch.randn(2, 3, 16, 16)
    fast = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0)
    name = "torchkiln compiled (float32)"
    fast._install(name, fast._find(name).make(), fast._order)
    with torch.no_grad():
        want = fast(x)
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        made_inside = x.clone()
        got = fast(made_inside)
        again = fast(x)
    assert counters["stats"]["unique_graphs"] == graphs
    assert fast.kiln_report.active == name
    assert torch.equal(got, want) and torch.equal(again, want)
    torch.testing.assert_close(got, model(x).detach(), rtol=1e-4, atol=1e-5)
