"""Lamb against a per-tensor reference written from the paper's Algorithm 2 (You et al. 2019)."""

import copy
import re

import pytest
import torch
from torch import nn

from torchkiln.optim import Lamb

from .common import assert_resume_is_exact, backward, batches, make_model

STEPS = 50
LR = 0.02


class ReferenceLamb:
    """One tensor at a time, ordinary ops, straight from the paper's equations."""

    def __init__(self, params, betas=(0.9, 0.999), eps=1e-6, weight_decay=(), excluded=(), trust_clip=None,
                 bias_correction=True, maximize=False):
        self.w = [p.detach().float().clone() for p in params]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [torch.zeros_like(w) for w in self.w]
        self.b1, self.b2 = betas
        self.eps, self.wd, self.excluded = eps, list(weight_decay), list(excluded)
        self.trust_clip, self.bias_correction, self.maximize = trust_clip, bias_correction, maximize
        self.t = 0
        self.clipped = 0

    def step(self, grads, lr):
        self.t += 1
        b1, b2, t = self.b1, self.b2, self.t
        for i, g in enumerate(grads):
            g = -g.float() if self.maximize else g.float()
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            mhat, vhat = self.m[i], self.v[i]
            if self.bias_correction:
                mhat, vhat = mhat / (1 - b1**t), vhat / (1 - b2**t)
            r = mhat / (vhat.sqrt() + self.eps)
            w = self.w[i]
            if self.excluded[i]:
                u, trust = r, 1.0
            else:
                u = r + self.wd[i] * w
                w_norm, u_norm = w.norm().item(), u.norm().item()
                trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                if self.trust_clip is not None and trust > self.trust_clip:
                    trust = self.trust_clip
                    self.clipped += 1
            self.w[i] = w - lr * trust * u


def lr_at(step):
    return LR * 0.5 ** (step // 10)  # StepLR(step_size=10, gamma=0.5), computed independently


def run_both(opt_factory, ref, model, data):
    opt = opt_factory(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    n_clipped_grads = 0
    for step, (x, y) in enumerate(data):
        n_clipped_grads += int(backward(model, x, y) > 0.5)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        sched.step()
        ref.step(grads, lr_at(step))
    assert n_clipped_grads > 0, "clip_grad_norm_ never clipped: the test does not cover it"
    return opt


def assert_matches(model, ref):
    # 1e-4/1e-5 after 50 steps: the compiled kernels round (FMA, fused divides) a little differently.
    for p, w in zip(model.parameters(), ref.w, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-4, atol=1e-5)


CASES = {
    "plain": dict(weight_decay=0.1),
    "exclude": dict(weight_decay=0.1, exclude_from_adaptation="bias_and_norm"),
    "clip": dict(weight_decay=0.1, trust_clip=0.5),
    "exclude-clip-maximize": dict(weight_decay=0.05, trust_clip=0.2, exclude_from_adaptation="bias_and_norm",
                                  maximize=True),
    "no-bias-correction": dict(weight_decay=0.1, bias_correction=False, betas=(0.8, 0.99)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case):
    kw = CASES[case]
    model = make_model()
    params = list(model.parameters())
    excluded = [kw.get("exclude_from_adaptation") == "bias_and_norm" and p.ndim <= 1 for p in params]
    ref = ReferenceLamb(params, weight_decay=[kw["weight_decay"]] * len(params), excluded=excluded,
                        betas=kw.get("betas", (0.9, 0.999)), trust_clip=kw.get("trust_clip"),
                        bias_correction=kw.get("bias_correction", True), maximize=kw.get("maximize", False))
    run_both(lambda m: Lamb(m.parameters(), lr=LR, **kw), ref, model, batches(STEPS))
    assert_matches(model, ref)
    if "trust_clip" in kw:
        assert ref.clipped > 0, "trust_clip never bit: the test does not cover it"


def test_param_group_overrides_match_reference():
    # Matrices decay more, the first bias not at all, LayerNorm is excluded, the other biases take
    # the defaults.
    model = make_model()
    params = list(model.parameters())
    ln = [model[1].weight, model[1].bias]
    groups = [{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.2},
              {"params": [model[0].bias], "weight_decay": 0.0},
              {"params": ln, "adapt": False},
              {"params": [model[3].bias, model[5].bias]}]
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in params)
    wd = [0.2 if p.ndim == 2 else 0.0 if p is model[0].bias else 0.1 for p in params]
    ref = ReferenceLamb(params, weight_decay=wd, excluded=[any(p is q for q in ln) for p in params])
    run_both(lambda m: Lamb(groups, lr=LR, weight_decay=0.1), ref, model, batches(STEPS))
    assert_matches(model, ref)


def test_trust_ratio_is_applied():
    # Without adaptation and decay, LAMB is Adam; with it, it must not be.
    data = batches(10)
    results = {}
    for name in ("adam", "lamb-unadapted", "lamb"):
        model = make_model()
        if name == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=LR, eps=1e-6)
        else:
            opt = Lamb([{"params": model.parameters(), "adapt": name == "lamb"}], lr=LR)
        for x, y in data:
            backward(model, x, y)
            opt.step()
        results[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(results["lamb-unadapted"], results["adam"], rtol=1e-4, atol=1e-5)
    assert (results["lamb"] - results["adam"]).abs().max() > 1e-2


def test_bf16_params_keep_fp32_state_also_after_load():
    model, data = make_model(torch.bfloat16), batches(3, torch.bfloat16)
    opt = Lamb(model.parameters(), lr=LR, weight_decay=0.1)
    for x, y in data:
        backward(model, x, y)
        start = [p.detach().float().clone() for p in model.parameters()]
        ref = ReferenceLamb(start, weight_decay=[0.1] * len(start), excluded=[False] * len(start))
        ref.m = [opt.state[p]["exp_avg"].clone() if opt.state else torch.zeros_like(w)
                 for p, w in zip(model.parameters(), start, strict=True)]
        ref.v = [opt.state[p]["exp_avg_sq"].clone() if opt.state else torch.zeros_like(w)
                 for p, w in zip(model.parameters(), start, strict=True)]
        ref.t = int(opt.state[next(model.parameters())]["step"]) if opt.state else 0
        opt.step()
        ref.step([p.grad for p in model.parameters()], LR)
        for p, w in zip(model.parameters(), ref.w, strict=True):
            assert p.dtype == torch.bfloat16
            # One rounding to bf16 of the fp32 result (2^-9 relative), not bf16 arithmetic throughout.
            torch.testing.assert_close(p.float(), w, rtol=2**-8, atol=1e-6)
    for s in opt.state.values():
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32

    saved = copy.deepcopy(opt.state_dict())
    fresh = Lamb(model.parameters(), lr=LR)
    fresh.load_state_dict(saved)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert fresh.state[p][key].dtype == torch.float32
            assert torch.equal(fresh.state[p][key], opt.state[p][key])  # not rounded through bf16


def test_state_dict_round_trip_continues_exactly():
    data = batches(20)

    def setup():
        model = make_model()
        opt = Lamb(model.parameters(), lr=LR, weight_decay=0.1, trust_clip=0.5,
                   exclude_from_adaptation="bias_and_norm")
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)

    assert_resume_is_exact(setup, data, {"step", "exp_avg", "exp_avg_sq"})


def test_grad_scaler_gives_the_unscaled_result():
    data = batches(3)
    results = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**10)):
        model = make_model()
        opt = Lamb(model.parameters(), lr=LR, weight_decay=0.1)
        for x, y in data:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)  # a power-of-two scale unscales exactly


def test_closure_and_missing_grads():
    model = make_model()
    unused = nn.Linear(3, 3)  # never in the forward: its grads stay None
    opt = Lamb(list(model.parameters()) + list(unused.parameters()), lr=LR)
    before = unused.weight.detach().clone()
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert torch.equal(unused.weight, before) and unused.weight not in opt.state
    assert opt.step(closure).item() < first.item()


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=-1e-3), "lr"),
    (dict(betas=(1.0, 0.999)), "betas[0]"),
    (dict(betas=(0.9, -0.1)), "betas[1]"),
    (dict(betas=(0.9,)), "betas"),
    (dict(eps=0.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(trust_clip=0.0), "trust_clip"),
    (dict(trust_clip=True), "trust_clip"),
    (dict(exclude_from_adaptation="biases"), "exclude_from_adaptation"),
])
def test_bad_hyperparameters_name_the_argument(kwargs, name):
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="^" + re.escape(name) + "="):
        Lamb([p], **kwargs)


def test_bad_group_override_is_rejected():
    with pytest.raises(ValueError, match="^lr="):
        Lamb([{"params": [nn.Parameter(torch.zeros(2))], "lr": -1.0}])


def test_sparse_gradients_raise_before_any_update():
    dense, emb = nn.Linear(4, 4), nn.Embedding(10, 4, sparse=True)
    opt = Lamb(list(dense.parameters()) + list(emb.parameters()))
    before = dense.weight.detach().clone()
    (dense(emb(torch.tensor([1, 2]))).sum()).backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(dense.weight, before)


def test_the_compiled_kernels_serve_when_available(form, monkeypatch):
    from torchkiln.optim import Lars, kernels

    calls = []
    real = kernels.step
    monkeypatch.setattr(kernels, "step", lambda name, ts, h: calls.append(name) or real(name, ts, h))
    model = make_model()
    for opt in (Lamb(model.parameters(), lr=1e-3), Lars(model.parameters(), lr=0.1)):
        backward(model, *next(iter(batches(1))))
        opt.step()
    n = len(list(model.parameters()))
    assert calls == (["lamb"] * n + ["lars"] * n if form == "compiled" else [])
