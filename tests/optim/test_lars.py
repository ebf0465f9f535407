"""Lars against a per-tensor reference written from You et al. 2017 (the variant lars.py documents:
local LR on the gradient, then momentum, global lr outside the buffer)."""

import copy
import re

import pytest
import torch
from torch import nn

from torchkiln.optim import Lars

from .common import assert_resume_is_exact, backward, batches, make_model

STEPS = 50
LR = 0.1


class ReferenceLars:
    """One tensor at a time, ordinary ops: the local LR of the paper, then SGD momentum."""

    def __init__(self, params, momentum=0.9, weight_decay=0.0, eta=0.001, eps=1e-9, nesterov=False,
                 trust_clip=False, excluded=()):
        self.w = [p.detach().float().clone() for p in params]
        self.buf = [torch.zeros_like(w) for w in self.w]
        self.momentum, self.wd, self.eta, self.eps = momentum, weight_decay, eta, eps
        self.nesterov, self.trust_clip, self.excluded = nesterov, trust_clip, list(excluded)
        self.clipped = 0

    def step(self, grads, lr):
        for i, g in enumerate(grads):
            g, w = g.float(), self.w[i]
            if self.excluded[i]:
                d = g
            else:
                w_norm, g_norm = w.norm().item(), g.norm().item()
                if w_norm > 0 and g_norm > 0:
                    trust = self.eta * w_norm / (g_norm + self.wd * w_norm + self.eps)
                else:
                    trust = 1.0
                if self.trust_clip and trust > 1.0:
                    trust = 1.0
                    self.clipped += 1
                d = (g + self.wd * w) * trust
            self.buf[i] = self.momentum * self.buf[i] + d
            step = d + self.momentum * self.buf[i] if self.nesterov else self.buf[i]
            self.w[i] = w - lr * step


def lr_factor(step):
    return 1.0 / (1 + 0.05 * step)  # LambdaLR's factor; applied to step s's lr after s scheduler steps


def run_both(opt, ref, model, data):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    n_clipped_grads = 0
    for step, (x, y) in enumerate(data):
        n_clipped_grads += int(backward(model, x, y) > 0.5)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        sched.step()
        ref.step(grads, LR * lr_factor(step))
    assert n_clipped_grads > 0, "clip_grad_norm_ never clipped: the test does not cover it"


def assert_matches(model, ref):
    # 1e-4/1e-5 after 50 steps: the compiled kernels round (FMA, fused divides) a little differently.
    for p, w in zip(model.parameters(), ref.w, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exclude", [None, "bias_and_norm"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("trust_clip", [False, True])
def test_matches_reference(exclude, nesterov, trust_clip):
    # eta = 1 makes eta ||w|| exceed ||g|| often, so trust_clip has something to clip.
    kw = dict(momentum=0.9, weight_decay=0.01, eta=1.0 if trust_clip else 0.02, nesterov=nesterov,
              trust_clip=trust_clip)
    model = make_model()
    params = list(model.parameters())
    ref = ReferenceLars(params, excluded=[exclude is not None and p.ndim <= 1 for p in params], **kw)
    run_both(Lars(params, lr=LR, exclude_from_adaptation=exclude, **kw), ref, model, batches(STEPS))
    assert_matches(model, ref)
    if trust_clip:
        assert ref.clipped > 0, "trust_clip never bit: the test does not cover it"


def test_param_group_overrides_and_no_momentum_match_reference():
    model = make_model()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim == 1]
    opt = Lars([{"params": matrices, "weight_decay": 0.05}, {"params": vectors, "adapt": False}], lr=LR,
               momentum=0.0, weight_decay=0.01, eta=0.02)
    params = list(model.parameters())
    ref = ReferenceLars(params, momentum=0.0, weight_decay=0.05, eta=0.02,
                        excluded=[p.ndim == 1 for p in params])
    run_both(opt, ref, model, batches(STEPS))
    assert_matches(model, ref)
    assert not opt.state, "momentum 0 needs no buffer"


@pytest.mark.parametrize("nesterov", [False, True])
def test_excluded_is_sgd_and_adapted_is_not(nesterov):
    data = batches(10)
    results = {}
    for name in ("sgd", "lars-unadapted", "lars"):
        model = make_model()
        if name == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, nesterov=nesterov)
        else:
            opt = Lars(model.parameters(), lr=LR, momentum=0.9, nesterov=nesterov, eta=0.02,
                       exclude_from_adaptation=(lambda p: True) if name == "lars-unadapted" else None)
        for x, y in data:
            backward(model, x, y)
            opt.step()
        results[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(results["lars-unadapted"], results["sgd"], rtol=1e-4, atol=1e-5)
    assert (results["lars"] - results["sgd"]).abs().max() > 1e-2


def test_zero_weights_get_trust_one():
    # A zero-initialised tensor would never move if ||w|| = 0 gave trust 0.
    w = nn.Parameter(torch.zeros(3, 3))
    opt = Lars([w], lr=0.1, momentum=0.0, eta=0.001)
    w.grad = torch.ones(3, 3)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3, 3), -0.1))


def test_bf16_params_keep_fp32_state_also_after_load():
    model, data = make_model(torch.bfloat16), batches(3, torch.bfloat16)
    opt = Lars(model.parameters(), lr=LR, weight_decay=0.01, eta=0.02)
    for x, y in data:
        backward(model, x, y)
        ref = ReferenceLars(model.parameters(), weight_decay=0.01, eta=0.02, excluded=[False] * 8)
        ref.buf = [opt.state[p]["momentum_buffer"].clone() if opt.state else torch.zeros_like(w)
                   for p, w in zip(model.parameters(), ref.w, strict=True)]
        opt.step()
        ref.step([p.grad for p in model.parameters()], LR)
        for p, w in zip(model.parameters(), ref.w, strict=True):
            assert p.dtype == torch.bfloat16
            # One rounding to bf16 of the fp32 result (2^-9 relative), not bf16 arithmetic throughout.
            torch.testing.assert_close(p.float(), w, rtol=2**-8, atol=1e-6)
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in opt.state.values())

    fresh = Lars(model.parameters(), lr=LR)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in model.parameters():
        assert fresh.state[p]["momentum_buffer"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_state_dict_round_trip_continues_exactly():
    data = batches(20)

    def setup():
        model = make_model()
        opt = Lars(model.parameters(), lr=LR, weight_decay=0.01, eta=0.02, nesterov=True,
                   exclude_from_adaptation="bias_and_norm")
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    assert_resume_is_exact(setup, data, {"momentum_buffer"})


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=-0.1), "lr"),
    (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.5), "momentum"),
    (dict(weight_decay=-1e-4), "weight_decay"),
    (dict(eta=0.0), "eta"),
    (dict(eps=-1e-9), "eps"),
    (dict(momentum=0.0, nesterov=True), "nesterov"),
    (dict(trust_clip=1.0), "trust_clip"),
    (dict(exclude_from_adaptation="norms"), "exclude_from_adaptation"),
])
def test_bad_hyperparameters_name_the_argument(kwargs, name):
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match="^" + re.escape(name) + "="):
        Lars([nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_group_override_is_rejected():
    with pytest.raises(ValueError, match="^momentum="):
        Lars([{"params": [nn.Parameter(torch.zeros(2))], "momentum": 2.0}], lr=0.1)


def test_sparse_gradients_raise():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Lars(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
