"""tk.optimize(model, optimizer=...): the training pair."""

import copy
import pickle
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import torchkiln as tk
import torchkiln.training as tr
from torchkiln.training import TrainModule


def net(dropout=0.0, bn=False):
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(64) if bn else nn.LayerNorm(64)
    return nn.Sequential(nn.Linear(32, 64), norm, nn.GELU(), nn.Dropout(dropout), nn.Linear(64, 10)).train()


def data(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def with_bf16(monkeypatch):
    """Plan as if this CPU had native bf16 (emulated bf16 still computes correctly here)."""
    hw = tk.detect()
    fake = replace(hw, cpu=replace(hw.cpu, features=tuple(hw.cpu.features) + ("avx512_bf16",)))
    monkeypatch.setattr(tr, "detect", lambda: fake)


def train(model, opt, steps, sched=None, clip=None, seed=2):
    x, y = data(seed=seed)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
    return loss.item()


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, weight_decay=1e-2),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_same_optimizer_object_fused_and_updates_match_stock(name):
    # Reference: the same loop with the stock (foreach) optimizer on an untouched copy.
    ref = net()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 5, 0.5)
    model = copy.deepcopy(ref)
    opt = OPTIMIZERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)  # made before optimize: must keep working
    fast, fast_opt = tk.optimize(model, optimizer=opt, sample_input=data()[0], time_budget=0)
    assert fast_opt is opt and all(g["fused"] for g in opt.param_groups)
    assert isinstance(fast, TrainModule)
    assert [p for p in fast.parameters()] == [p for p in model.parameters()]
    train(fast, opt, 15, sched, clip=1.0)
    train(ref, ref_opt, 15, ref_sched, clip=1.0)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < OPTIMIZERS[name]([torch.zeros(1)]).defaults["lr"]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_optimizer_without_fused_step_keeps_its_own_and_says_so():
    model = net()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fast, _ = tk.optimize(model, optimizer=opt)
    assert "fused" not in opt.defaults or not opt.defaults["fused"]
    assert fast.kiln_recipe.optimizer == "own step"
    assert any("RMSprop" in str(x.message) for x in w)


def test_checkpoints_load_both_ways():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fast, opt = tk.optimize(model, optimizer=opt, time_budget=0)
    train(fast, opt, 3)
    ckpt = {"model": copy.deepcopy(fast.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    assert not any(k.startswith(("kiln", "_orig_mod", "model.")) for k in ckpt["model"])
    # Into plain PyTorch: a fresh model and a stock (non-fused) optimizer ...
    plain = net()
    plain.load_state_dict(ckpt["model"])
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(ckpt["opt"])
    for g in plain_opt.param_groups:
        g["fused"], g["foreach"] = None, None
    # ... and continuing there equals continuing here.
    train(fast, opt, 3, seed=5)
    train(plain, plain_opt, 3, seed=5)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    # The reverse: a stock checkpoint into the optimized pair, which stays fused (loading put the stock
    # optimizer's fused=None back, and the fused step was gone: a new-user probe, thirty-seventh session).
    fused = all(g["fused"] for g in opt.param_groups)  # where torch has a fused AdamW step for this device
    fast.load_state_dict(plain.state_dict())
    opt.load_state_dict(plain_opt.state_dict())
    assert plain_opt.param_groups[0]["fused"] is None
    assert all(g["fused"] is fused for g in opt.param_groups)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_model_holding_the_pair_saves_and_loads_its_checkpoint():
    # A parent (the user's wrapper with a loss head, or DDP(model)) walks _modules to load, which the
    # returned model keeps empty: every key of its subtree came back "unexpected" and nothing loaded.
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    parent = nn.ModuleDict({"net": fast, "head": nn.Linear(10, 2)})
    source = nn.ModuleDict({"net": net(), "head": nn.Linear(10, 2)})  # the same keys, other values
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    assert list(parent.state_dict()) == list(source.state_dict())
    assert parent.load_state_dict(source.state_dict()).missing_keys == []
    for (k, p), q in zip(parent.state_dict().items(), source.state_dict().values(), strict=True):
        assert torch.equal(p, q), k
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), source["net"].parameters(), strict=True))
    # The parent's verdict on keys holds as for any child: a key the subtree lacks is unexpected ...
    extra = {**source.state_dict(), "net.9.weight": torch.zeros(1)}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "net.9.weight"'):
        parent.load_state_dict(extra)
    assert parent.load_state_dict(extra, strict=False).unexpected_keys == ["net.9.weight"]
    # ... one it misses is missing, and a wrong shape is an error.
    short = {k: v for k, v in source.state_dict().items() if k != "net.4.bias"}
    assert parent.load_state_dict(short, strict=False).missing_keys == ["net.4.bias"]
    bad = {**source.state_dict(), "net.0.weight": torch.zeros(3, 3)}
    with pytest.raises(RuntimeError, match="size mismatch"):
        parent.load_state_dict(bad)


def test_the_pair_shows_the_models_own_class_and_copies_keep_the_wrapper():
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    assert isinstance(fast, nn.Sequential) and type(fast) is TrainModule and isinstance(fast, TrainModule)
    x, y = data()
    for copied in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert type(copied) is TrainModule and isinstance(copied, nn.Sequential)
        # each copy sets up and times its own forms: eager and compiled differ by float32 rounding
        torch.testing.assert_close(copied(x), fast(x), rtol=1e-5, atol=1e-6)


def test_a_model_cast_to_bf16_is_checked_against_itself_and_said_so():
    # pure-bf16 fine-tuning: the compiled step was judged against float32's tolerance and never served,
    # and the recipe said the parameters "stay float32"
    model = net().bfloat16()
    ref = copy.deepcopy(model)
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), time_budget=0)
    assert fast.kiln_recipe.notes[0].startswith("the model's parameters are bfloat16")
    x, y = data()
    x = x.bfloat16()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for m, o in ((fast, opt), (ref, ref_opt)):
        for _ in range(2):
            o.zero_grad()
            nn.functional.cross_entropy(m(x).float(), y).backward()
            o.step()
    rep = fast.kiln_report
    assert rep.guard["ok"] and rep.guard["reference"].startswith("eager bfloat16"), rep.guard
    # the report and recipe name the dtype it trains in (they read float32 and "fp32")
    assert (fast.kiln_recipe.dtype, fast.kiln_recipe.precision, rep.dtype_served) == ("bfloat16", "params", "bfloat16")
    assert rep.active.endswith("(bfloat16)") and rep.applied[0] == "bfloat16 parameters (as given)", rep
    assert not any("tolerance" in f.reason for f in rep.fallbacks), rep.fallbacks
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):  # bf16 rounding apart
        assert p.dtype == torch.bfloat16
        assert float((p.float() - q.float()).norm() / q.float().norm()) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_fused_step_is_taken_only_where_it_computes_the_stock_steps_numbers(dtype):
    # torch's CPU fused SGD skipped every full vector block of a bf16/fp16 parameter (pytorch#191763):
    # whether torchkiln fuses must follow what torch's kernel does, found here on other values
    from torchkiln.training.fuse import fused_supported

    start = torch.randn(200, generator=torch.Generator().manual_seed(3)).to(dtype)
    moved = {}
    for fused in (True, False):
        p = start.clone().requires_grad_()
        p.grad = torch.full_like(p, 0.5)
        torch.optim.SGD([p], lr=0.1, fused=fused, foreach=False if not fused else None).step()
        moved[fused] = float((p.detach().float() - start.float()).norm())
    agrees = abs(moved[True] - moved[False]) <= 0.05 * moved[False]
    assert fused_supported(torch.optim.SGD, "cpu", dtype) == agrees
    model = net().to(dtype)
    _, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    assert bool(opt.param_groups[0]["fused"]) == agrees


@pytest.mark.parametrize("knobs", [{"level": "O0"}, {"graph_mode": False}])
def test_without_a_compiled_step_the_report_says_eager_serves(knobs):
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **knobs)
    train(fast, opt, 2)
    assert fast.kiln_report.active == "eager (float32)"  # was "pending first call" for good
    assert "serving: eager (float32)" in str(fast.kiln_report)


def test_setup_leaves_grads_buffers_and_rng_untouched():
    model = net(dropout=0.2, bn=True)
    x, y = data()
    nn.functional.cross_entropy(model(x), y).backward()  # grads already there
    grads = [p.grad.clone() for p in model.parameters()]
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sample_input=x, time_budget=0)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), stats, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and model[3].training  # dropout back on


def test_guard_rejects_a_wrong_compiled_step(monkeypatch):
    build = TrainModule._build

    def wrong(self):
        build(self)
        eager = self._eager
        object.__setattr__(self, "_compiled", lambda *a, **k: eager(*a, **k) * 1.01)  # a 1% error

    monkeypatch.setattr(TrainModule, "_build", wrong)
    model = net()
    with pytest.warns(UserWarning, match="rejected"):
        fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              sample_input=data()[0], time_budget=0)
    assert fast.kiln_report.active.startswith("eager")
    reason = fast.kiln_report.fallbacks[0].reason
    assert reason.startswith(("output [", "gradient [")) and "tolerance" in reason


def test_later_failure_of_the_compiled_step_steps_down_to_eager():
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    x, y = data()
    fast(x)
    object.__setattr__(fast, "_fn", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("inductor broke")))
    with pytest.warns(UserWarning, match="stepping down"):
        out = fast(x)
    torch.testing.assert_close(out, model(x))
    assert fast.kiln_report.active.startswith("eager") and "inductor broke" in fast.kiln_report.fallbacks[-1].reason


def test_train_eval_switching_and_no_grad():
    model = net(dropout=0.5)
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    x, _ = data()
    fast.eval()
    assert not model.training and not fast.training
    with torch.no_grad():
        torch.testing.assert_close(fast(x), fast(x))  # dropout off: deterministic
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    fast.train()
    assert model.training and model[3].training


def test_bf16_autocast_with_fp32_parameters(monkeypatch):
    with_bf16(monkeypatch)
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, sample_input=data()[0], time_budget=0)
    r = fast.kiln_recipe
    assert (r.dtype, r.precision) == ("bfloat16", "autocast")
    x, y = data()
    out = fast(x)
    assert out.dtype == torch.float32  # back in the input's dtype for the loss
    nn.functional.cross_entropy(out, y).backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert fast.kiln_report.guard["ok"]


def test_bf16_without_native_support_trains_fp32_with_a_warning(monkeypatch):
    hw = tk.detect()
    plain = replace(hw, cpu=replace(hw.cpu, features=tuple(f for f in hw.cpu.features
                                                             if f not in ("avx512_bf16", "amx_bf16", "bf16"))))
    monkeypatch.setattr(tr, "detect", lambda: plain)
    model = net()
    with pytest.warns(UserWarning, match="no native bf16"):
        fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)
    assert fast.kiln_recipe.dtype == "float32"


def test_fp16_on_a_cpu_without_fp16_is_an_error_naming_the_alternative():
    model = net()
    if tk.detect().cpu.fp16_native:
        pytest.skip("this CPU has native fp16")
    with pytest.raises(ValueError, match=r"float16.*(bfloat16|None)"):
        tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.float16)


def test_bad_input_gets_clear_errors():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"eval mode.*model.train\(\)"):
        tk.optimize(copy.deepcopy(model).eval(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"none of the model.s parameters .*torch.optim.SGD\(model.parameters\(\)"):
        tk.optimize(model, optimizer=torch.optim.SGD(net().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        tk.optimize(model, optimizer="adam")
    # inference-only arguments were dropped without a word (a new-user probe, thirty-seventh session)
    with pytest.raises(ValueError, match=r"^quantize= serve inference and cannot be used with optimizer="):
        tk.optimize(model, optimizer=opt, quantize="int8-dynamic")
    with pytest.raises(ValueError, match=r"^calib_data=, candidates= serve inference"):
        tk.optimize(model, optimizer=opt, calib_data=[torch.randn(2, 8)], candidates="torchkiln")
    fast, opt = tk.optimize(model, optimizer=opt)
    with pytest.raises(ValueError, match="already optimized"):
        tk.optimize(fast, optimizer=opt)
    with pytest.raises(ValueError, match="already optimized"):
        tk.optimize(model, optimizer=opt)


def test_grad_scaler_and_accumulation_work_with_the_pair():
    model = net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    fast, opt = tk.optimize(model, optimizer=opt, time_budget=0)
    scaler, ref_scaler = tk.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for m, o, s in ((fast, opt, scaler), (ref, ref_opt, ref_scaler)):
        for step in range(4):
            x, y = data(seed=10 + step)
            s.scale(nn.functional.cross_entropy(m(x), y) / 2).backward()  # accumulate 2 micro-batches
            if step % 2 == 1:
                s.step(o)
                s.update()
                o.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_deepcopy_and_pickle_of_the_training_model():
    import pickle

    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    x, _ = data()
    for copied in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        torch.testing.assert_close(copied(x), fast(x), rtol=1e-5, atol=1e-6)
        assert copied.kiln_original is not model


class FunctionalDropout(nn.Module):
    """Dropout decided by the module's own training flag, as transformers' attention does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.b(nn.functional.dropout(torch.relu(self.a(x)), 0.5, self.training))


def test_guard_compares_without_any_dropout_noise():
    model = FunctionalDropout().train()
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sample_input=data()[0],
                          time_budget=0)
    compiled = next(m for m in fast.kiln_report.candidates if m.kind == "torchkiln")
    assert compiled.status in ("served", "passed"), compiled.reason
    assert fast.kiln_report.guard["ok"] and model.training


def test_the_compiled_cpu_step_drops_with_hashed_masks(monkeypatch):
    from torchkiln.training.module import TrainModule

    monkeypatch.setattr(TrainModule, "_time", lambda self, cands, by, args, kwargs: "compiled")  # tiny: eager wins
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Dropout(0.5), nn.Linear(256, 10)).train()
    ref = copy.deepcopy(model).eval()
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sample_input=data()[0],
                          time_budget=0)
    assert "hash_dropout" in [p.name for p in fast.kiln_recipe.passes]
    assert fast.kiln_report.active.startswith("compiled")
    assert any(a.startswith("hash_dropout") for a in fast.kiln_report.applied), fast.kiln_report.applied
    x = data()[0]
    a, b = fast(x), fast(x)
    assert not torch.equal(a, b)  # each call draws new masks
    # Inverted dropout is unbiased: the mean over many draws is the eval output, within 6 standard errors.
    with torch.no_grad():
        draws = torch.stack([fast(x) for _ in range(400)])
        sigma = draws.std(0) / 20  # the standard error of a 400-draw mean
        assert ((draws.mean(0) - ref(x)).abs() <= 6 * sigma + 1e-5).all()
        assert (a - ref(x)).abs().mean() > 0.1
        fast.eval()
        torch.testing.assert_close(fast(x), ref(x))  # eval: no dropout at all


@pytest.mark.slow  # emulated bf16 compile on an AVX2 CPU: about 75 s
def test_hf_causal_lm_with_labels_passes_the_guard_in_bf16(monkeypatch):
    # Its own loss is one of the compared outputs; the H200 run of GPT-2-medium was rejected
    # when the backprop projection itself was compared (cancellation inflates its error).
    transformers = pytest.importorskip("transformers")
    with_bf16(monkeypatch)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 256, (4, 32))
    fast, opt = tk.optimize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), dtype=torch.bfloat16,
                            sample_input={"input_ids": ids, "labels": ids}, time_budget=0)
    compiled = next(m for m in fast.kiln_report.candidates if m.kind == "torchkiln")
    assert compiled.status in ("served", "passed"), compiled.reason
    assert fast.kiln_report.guard["outputs"][0]["rel"] < 1e-2  # the loss itself
    out = fast(input_ids=ids, labels=ids)
    # The model's own loss is what the loop uses: float32, as transformers computes it; the logits stay
    # as autocast made them (as under stock autocast), not cast back at the cost of a float32 copy.
    assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, stock.loss, rtol=2e-2, atol=0)
    assert fast(ids).logits.dtype == torch.float32  # no loss of its own: outputs back in float32
    out.loss.backward()
    opt.step()
    assert torch.isfinite(out.loss)


class ZeroGrad(nn.Module):
    """Attention's key bias: its gradient is zero in exact arithmetic (a softmax ignores the
    constant q.b it adds to a row of scores), rounding noise in practice."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x):
        return torch.softmax(self.q(x) @ self.k(x).T, -1) @ x * 10


def test_gradients_that_are_rounding_noise_do_not_fail_the_guard():
    from torchkiln.training.module import _errors, _grad_scale

    model = ZeroGrad().train()
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sample_input=data()[0],
                          time_budget=0)
    assert fast.kiln_report.guard["ok"], fast.kiln_report.guard
    # The floor is relative to the other gradients: a real error in a real gradient still fails.
    ref = [torch.ones(4), torch.ones(100), torch.full((3,), 1e-9)]
    got = [torch.ones(4), torch.ones(100) * 1.01, torch.full((3,), -1e-9)]
    errs = _errors(got, ref, 1, _grad_scale(ref[1:]))
    assert errs[1].rel > 5e-3 and errs[2].rel < 1e-4


def test_gradient_noise_floor_is_one_rounding_unit_of_the_median_norm_in_low_precision():
    from torchkiln.training.module import _grad_scale

    grads = [torch.full((4,), 1.0), torch.full((9,), 2.0), torch.full((16,), 0.5)]  # norms 2, 6, 2
    assert _grad_scale(grads) == pytest.approx(1e-1 * 2.0)  # float32: see _grad_scale and the conv-bias test
    assert _grad_scale(grads, torch.bfloat16) == pytest.approx(2.0 ** -7 * 2.0)
    assert _grad_scale(grads, torch.float16) == pytest.approx(1e-3 * 2.0)  # fp16's eps (2^-10) is below 1e-3


def _oom_on(monkeypatch, which):
    """probe.step raises a device out-of-memory error for the step of ``which`` (a callable picker)."""
    from torchkiln.training import probe

    real = probe.step

    def step(fn, *a, **k):
        if which(fn):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(fn, *a, **k)

    monkeypatch.setattr(probe, "step", step)


def test_a_float32_reference_that_does_not_fit_falls_back_to_the_eager_step(monkeypatch):
    """The float32 truth step keeps twice the activations of a bf16 one; where it runs out of memory the
    guard compares against eager in the served precision, says so, and serves a step (no error)."""
    with_bf16(monkeypatch)
    model = net()
    _oom_on(monkeypatch, lambda fn: fn is model)
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                            sample_input=data()[0], time_budget=0)
    guard = fast.kiln_report.guard
    assert "ran out of device memory" in guard["reference"] and guard["reference"].startswith("eager bfloat16")
    assert guard["ok"], guard  # compiled bf16 against eager bf16: well inside bf16's cap
    x, y = data()
    loss = nn.functional.cross_entropy(fast(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


def test_a_compiled_step_that_does_not_fit_is_rejected_and_eager_serves(monkeypatch):
    with_bf16(monkeypatch)
    model = net()
    _oom_on(monkeypatch, lambda fn: hasattr(fn, "_orig_mod"))  # the torch.compile'd step
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                              sample_input=data()[0], time_budget=0)
    compiled = next(m for m in fast.kiln_report.candidates if m.kind == "torchkiln")
    assert compiled.status == "failed" and "ran out of device memory" in compiled.reason
    assert fast.kiln_report.active.startswith("eager")
    assert any("ran out of device memory" in str(w.message) for w in seen)


def test_a_float32_step_that_does_not_fit_is_the_callers_error(monkeypatch):
    # float32 training: the reference step is the user's own step; if it does not fit, neither does their loop
    model = net()
    _oom_on(monkeypatch, lambda fn: fn is model)
    with pytest.raises(torch.OutOfMemoryError):
        fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sample_input=data()[0],
                              time_budget=0)
        fast(data()[0]).sum().backward()


def test_when_no_reference_fits_the_compiled_step_serves_unverified_and_says_so(monkeypatch):
    # GPT-2-medium bs16 seq512 under a 24 GiB cap on the H200: the float32 and the eager bf16 steps ran out of
    # memory, the compiled bf16 step fits (benchmarks/diag_train_memory.py)
    from torchkiln.training.module import AutocastStep

    with_bf16(monkeypatch)
    model = net()
    _oom_on(monkeypatch, lambda fn: fn is model or isinstance(fn, AutocastStep))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                                sample_input=data()[0], time_budget=0)
    rep = fast.kiln_report
    assert rep.guard["ok"] is None and "not verified" in rep.guard["note"]
    assert rep.active.startswith("compiled")
    assert any("serves unverified" in str(w.message) for w in seen)
    eager = next(m for m in rep.candidates if m.kind == "eager")
    assert eager.status == "failed" and "OutOfMemoryError" in eager.reason
    x, y = data()
    loss = nn.functional.cross_entropy(fast(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


def test_cpu_training_keeps_freed_memory_after_the_candidates_and_reports_it(monkeypatch):
    from torchkiln.runtime import allocator

    if allocator.why_not() is not None:
        pytest.skip(f"needs glibc's malloc: {allocator.why_not()}")
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or "glibc malloc keeps it")
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert fast.kiln_recipe.allocator == "keep"
    assert calls == []  # nothing process-wide before the candidates are built and timed (first training call)
    train(fast, opt, 1)
    assert calls == [1] and "allocator: glibc malloc keeps it" in fast.kiln_report.applied
    model = net()  # no compiled candidate: set at once
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), graph_mode=False)
    assert calls == [1, 1] and "allocator: glibc malloc keeps it" in fast.kiln_report.applied
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), cpu_allocator="default")
    train(fast, opt, 1)
    assert calls == [1, 1] and fast.kiln_recipe.allocator == "default"
    assert not any("allocator" in a for a in fast.kiln_report.applied)


def test_a_refused_setting_is_a_reported_fallback(monkeypatch):
    from torchkiln.runtime import allocator

    if allocator.why_not() is not None:
        pytest.skip(f"needs glibc's malloc: {allocator.why_not()}")

    def refuse():
        raise OSError("glibc's mallopt refused the settings")
    monkeypatch.setattr(allocator, "keep_freed_memory", refuse)
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    train(fast, opt, 1)
    assert any(f.reason == "glibc's mallopt refused the settings" for f in fast.kiln_report.fallbacks)


def test_where_malloc_cannot_be_set_training_goes_on_and_says_why(monkeypatch):
    from torchkiln.runtime import allocator

    monkeypatch.setattr(allocator, "_DONE", None)
    monkeypatch.setattr(allocator, "why_not", lambda: "tcmalloc is loaded (it replaces glibc's malloc)")
    model = net()
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert fast.kiln_recipe.allocator == "default"
    assert any("allocator: left as it is: tcmalloc is loaded" in n for n in fast.kiln_recipe.notes)
    train(fast, torch.optim.SGD(fast.parameters(), lr=0.1), 1)  # and it trains


def test_the_allocator_knob_warns_for_inference():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tk.optimize(net().eval(), cpu_allocator="keep")
    assert any("cpu_allocator applies to training" in str(x.message) for x in w)


def test_the_reported_timing_leaves_out_compiling_and_warm_up(monkeypatch):
    import time as _time

    from torchkiln.training import probe

    real, seen = probe.step, set()

    def slow_first(fn, params, args, kwargs, keep=True, cache=None):  # a warm-up call that takes 0.6 s
        if not keep and id(fn) not in seen:
            seen.add(id(fn))
            _time.sleep(0.6)
        return real(fn, params, args, kwargs, keep=keep, cache=cache)

    monkeypatch.setattr(probe, "step", slow_first)
    model = net()
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sample_input=data()[0],
                          time_budget=0)
    rep = fast.kiln_report
    assert len(seen) >= 2 and rep.first_call_seconds > 1.2  # both candidates warmed up, slowly
    assert rep.selection_seconds < 0.5, rep.selection_seconds  # the timed rounds of a tiny net only


def test_ipex_training_recipe_under_autocast_runs_the_step_with_the_callers_autocast_off(monkeypatch):
    """IPEX's bf16 training loop calls the model under torch.cpu.amp.autocast(): the step applies that
    autocast itself, so the caller's is off inside (no second compile of the step); a caller's autocast at
    another dtype reaches the step as it is. Losses match the same loop without the caller's autocast."""
    with_bf16(monkeypatch)
    # the same step served in both runs (timed, eager and compiled traded places at this size, and their
    # bf16 losses differ by ~2e-4)
    monkeypatch.setattr(TrainModule, "_time", lambda self, cands, by, args, kwargs: "compiled")
    runs = {}
    for outer in (False, True):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, time_budget=0)
        x, y = data()
        losses, seen = [], []
        for step in range(3):
            if step == 1:  # set up by now: watch what the served step sees
                served = fast._fn
                object.__setattr__(fast, "_fn", lambda *a, s=served, log=seen, **k: log.append(
                    torch.is_autocast_enabled("cpu")) or s(*a, **k))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer):
                loss = nn.functional.cross_entropy(fast(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert seen == [False, False]
        runs[outer] = losses
        if outer:
            with torch.autocast("cpu", dtype=torch.float16):
                fast(x)
            assert seen[-1] is True
    assert runs[True] == pytest.approx(runs[False], rel=1e-6)


def test_a_conv_bias_before_batchnorm_does_not_fail_the_float32_guard():
    """That bias's gradient is exactly zero in exact arithmetic (the norm subtracts the mean): rounding
    leaves ~5e-8 in eager and ~1e-5 in the compiled step against a median gradient norm of 0.1, and the
    compiled step was rejected for it (a new-user probe, thirty-seventh session)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Conv2d(16, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).train()
    x = torch.randn(8, 3, 16, 16)
    fast, opt = tk.optimize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.05), sample_input=x)
    assert fast.kiln_report.guard["ok"], fast.kiln_report.guard  # (a real error still fails: the tests above)


def test_a_bad_first_batch_is_the_callers_error_and_leaves_the_compiled_step_in_the_running():
    """One bad first call counted against the compiled step, and training stayed eager for good; a bad
    sample_input only warned (a new-user probe, thirty-seventh session)."""
    model = net()
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    x, _y = data()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # as eager raises it
        fast(x[:, :-1])
    assert fast.kiln_report.fallbacks == [] and fast._fn is None  # nothing decided yet
    fast(x)
    compiled = next(m for m in fast.kiln_report.candidates if m.name.startswith("compiled"))
    assert compiled.status in ("served", "passed"), fast.kiln_report
    with pytest.raises(ValueError, match=r"^sample_input does not run through the model: RuntimeError: mat1"):
        other = net()
        tk.optimize(other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), sample_input=x[:, :-1])


class TokenLoss(nn.Module):
    """A model computing its own loss from labels, which the HF habit passes as the input ids themselves."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_labels_that_are_the_input_ids_compile_no_new_graph_in_the_loop(monkeypatch):
    # dynamo guards on two arguments being one tensor: setup detaching them apart compiled the step a
    # third time at the loop's first call (bert-large on the H200: ~60 s more).
    from torch._dynamo.utils import counters

    monkeypatch.setattr(TrainModule, "_time", lambda self, fns, by, args, kwargs: "compiled")
    model = TokenLoss().train()
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(3):  # the first call sets up (one compile: no dropout, no graph break), then the loop
        opt.zero_grad()
        fast(ids, ids).backward()
        opt.step()
    assert fast.kiln_report.active.startswith("compiled"), fast.kiln_report
    assert counters["stats"]["unique_graphs"] == graphs + 1


class WarnsOnce(TokenLoss):
    """GPT-2's ``loss_function`` calls transformers' ``logger.warning_once`` on every call (its loss_type is
    unset), a graph break for dynamo."""

    def forward(self, input_ids, labels):
        hidden = self.emb(input_ids)
        self.logger.warning_once(self.message)
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


def test_a_once_only_transformers_warning_breaks_no_graph_in_the_step_of_any_model(monkeypatch, caplog):
    # With the graph break, each model's step left the model class's own frames compiled apart, two cache
    # entries per model on frames every model of the class shares: the fifth model hit dynamo's recompile
    # limit (8) and ran them eager while its report said compiled.
    from torch._dynamo.utils import counters

    monkeypatch.setattr(TrainModule, "_time", lambda self, fns, by, args, kwargs: "compiled")
    transformers = pytest.importorskip("transformers")
    WarnsOnce.logger = transformers.utils.logging.get_logger("torchkiln.tests")  # at module level, as HF does
    WarnsOnce.message = f"loss_type unset ({id(caplog)})"  # warning_once is lru-cached per message
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    added = []
    for _ in range(5):
        model = WarnsOnce().train()
        ref = copy.deepcopy(model)
        graphs = counters["stats"]["unique_graphs"]
        fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            for m, o in ((fast, opt), (ref, ref_opt)):
                o.zero_grad()
                m(ids, ids).backward()
                o.step()
        added.append(counters["stats"]["unique_graphs"] - graphs)
        assert fast.kiln_report.active.startswith("compiled"), fast.kiln_report
        torch.testing.assert_close(fast.head.weight, ref.head.weight, rtol=1e-5, atol=1e-6)
    assert added == [1] * 5, added  # one graph for each model's step, the fifth's included (not 2: the break's)
    assert [r.getMessage() for r in caplog.records].count(WarnsOnce.message) == 1  # printed once, by eager


class Breaks(nn.Module):
    """Dropout, then a graph break: the class's forward is compiled apart from each model's step."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(16, 16), nn.Linear(16, 4), nn.Dropout(0.1)

    def forward(self, x):
        x = self.drop(torch.relu(self.a(x)))
        torch._dynamo.graph_break()
        return self.b(x)


def test_a_step_whose_shared_frames_hit_the_recompile_limit_is_reported_partly_eager(monkeypatch):
    # The frames after a graph break are the class's code, shared by every model of the class: each optimized
    # model took two of dynamo's cache entries there (stock torch.compile: one), and past the limit they ran
    # eager while the report said "compiled", from the fifth model on (stock: the ninth). Checked against
    # dynamo's cache itself, read before each model's setup.
    import torch._dynamo.config as dynamo_config
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    from torchkiln.training.module import LIMIT_FACTOR

    monkeypatch.setattr(TrainModule, "_time", lambda self, fns, by, args, kwargs: "compiled")
    users = getattr(dynamo_config, "recompile_limit", None) or dynamo_config.cache_size_limit
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    flagged, full_before = [], []
    for _ in range(users + 2):  # two entries per model at most: the step's limit (2x the user's) is reached
        full_before.append(len(entries(Breaks.forward.__code__)) >= LIMIT_FACTOR * users)
        model = Breaks().train()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
            nn.functional.cross_entropy(fast(x), y).backward()
        rep = fast.kiln_report
        flagged.append(any("recompile limit" in f.reason for f in rep.fallbacks))
        assert flagged[-1] == ("recompile limit" in rep.active) == any("recompile limit" in str(m.message) for m in w)
        if flagged[-1]:
            assert "Breaks.forward" in rep.fallbacks[-1].reason, rep.fallbacks
    assert flagged == full_before, (flagged, full_before)
    # torch 2.13 adds entries per model and reaches the limit, after as many models as stock compile allows;
    # torch 2.6 reuses one model's entries for the next (2 after six models) and never reaches it
    if any(full_before):
        assert full_before.index(True) >= users, full_before
    else:
        assert len(entries(Breaks.forward.__code__)) < LIMIT_FACTOR * users


def test_the_report_tells_a_step_without_dropout_from_a_cached_graph():
    from torchkiln.passes.hash_dropout import HashDropoutPass
    from torchkiln.training.module import _dropout_said

    p = HashDropoutPass()
    assert _dropout_said(p).startswith("no new compile")  # never called: every graph from inductor's cache
    p(torch.fx.symbolic_trace(nn.Linear(2, 2)).graph)  # a graph without dropout
    assert (p.graphs, p.rewritten) == (1, 0) and _dropout_said(p) == "no dropout in the compiled step"
    p.rewritten = 3
    assert _dropout_said(p) == "3 dropout sites in the compiled step"


def test_the_margin_over_eager_is_2x_for_gradients_and_a_quarter_for_outputs():
    from types import SimpleNamespace as E

    from torchkiln.training.module import _margins

    cap = 0.05
    eager = [E(rel=0.06, shapes_match=True),    # an output past the cap: 1.25x eager's error
             E(rel=0.01, shapes_match=True),    # a gradient well within the cap: the tolerance given
             E(rel=0.0429, shapes_match=True),  # a gradient just under the cap: 2x, not the clipped cap
             E(rel=0.15, shapes_match=True),    # a gradient eager misses (bf16 noise): 2x
             E(rel=0.15, shapes_match=False)]   # shapes differ: the tolerance given
    tols = _margins([cap] * 5, eager, n_out=1)
    assert tols == pytest.approx([0.075, cap, 0.0858, 0.30, cap])
    # bert-large on the H200: [374] read 0.0569 against eager's 0.0429 and [357] 0.218 against 0.153; both
    # pass now, and a wrong gradient (relative error ~1) still fails
    for got, base in ((0.0569, 0.0429), (0.218, 0.153)):
        assert got <= _margins([cap], [E(rel=base, shapes_match=True)], n_out=0)[0] < 1.0
    assert _margins([cap], [E(rel=0.06, shapes_match=True)], n_out=1)[0] < 0.0858  # outputs stay at 1.25x


def test_an_optimizer_also_holding_a_parameter_besides_the_models_trains_it_as_eager_does():
    model, ref = net(), net()
    temp, ref_temp = nn.Parameter(torch.tensor(1.5)), nn.Parameter(torch.tensor(1.5))  # a learnable loss temperature
    fast, opt = tk.optimize(model, optimizer=torch.optim.AdamW([*model.parameters(), temp], lr=1e-2), time_budget=0)
    ref_opt = torch.optim.AdamW([*ref.parameters(), ref_temp], lr=1e-2)
    x, y = data()
    for m, o, t in ((fast, opt, temp), (ref, ref_opt, ref_temp)):
        for _ in range(3):
            o.zero_grad()
            nn.functional.cross_entropy(m(x) / t, y).backward()
            o.step()
    torch.testing.assert_close(temp, ref_temp, rtol=1e-5, atol=1e-6)
    assert temp.item() != 1.5
    for a, b in zip(fast.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
