"""Split bf16 master weights (training/split.py): bf16 weights plus 16-bit trails that
rebuild the float32 masters exactly, stepped by the optimizer's own arithmetic."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.optim import Lamb
from torchkiln.training import split as S

from .test_training import data, net, with_bf16


def test_halves_rebuild_every_float32_bit_pattern_and_round_like_a_bf16_cast():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(200_000, generator=g) * torch.logspace(-35, 35, 200_000)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45,
                            float("inf"), -float("inf")])
    ties = ((torch.randint(0, 2**15, (500,), generator=g, dtype=torch.int32) << 16) | 0x8000).view(torch.float32)
    x = torch.cat([wide, special, ties, -ties])
    top, trail = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int16)
    S._split_into(x, top, trail)
    assert torch.equal(S._combine(top, trail).view(torch.int32), x.view(torch.int32))
    # The bf16 half is torch's round-to-nearest-even cast everywhere except exact ties (away from zero).
    differs = top.view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)
    is_tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert differs.any() and bool(is_tie[differs].all())
    assert not differs[: wide.numel()][~is_tie[: wide.numel()]].any()


OPTIMIZERS = {
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "Lamb": lambda p: Lamb(p, lr=1e-2, weight_decay=1e-2),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_masters_follow_the_optimizer_exactly_over_many_chunked_steps(name, monkeypatch):
    # Reference: the same optimizer on float32 copies fed the same gradients (the split model's
    # bf16 gradients, clipped), with an LR scheduler made before the split and one made after.
    monkeypatch.setattr(S, "CHUNK", 64 * 32 + 1)  # every weight in its own chunk, biases with the first
    model = net()
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    before = torch.optim.lr_scheduler.StepLR(opt, 4, 0.5)
    sw = S.SplitWeights(S.split_params(model, opt), opt)
    after = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_scheds = (torch.optim.lr_scheduler.StepLR(ref_opt, 4, 0.5),
                  torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s)))
    assert len(sw.params) == 2 and len(sw.chunks) == 2
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] + [torch.float32] * 3 + [torch.bfloat16,
                                                                                                  torch.float32]
    x, y = data()
    for _ in range(12):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for s in (before, after, *ref_scheds):
            s.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    index = {id(p): i for i, p in enumerate(sw.params)}
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        master = sw.master(index[id(p)]) if id(p) in index else p.detach()
        assert master.dtype == torch.float32
        # torch's steps: the same arithmetic, bit for bit. Lamb picks its compiled per-tensor kernel or
        # the _foreach form by the list it is given, and the two differ in the last bit.
        exact = name != "Lamb"
        torch.testing.assert_close(master, q.detach(), rtol=0 if exact else 1e-5, atol=0 if exact else 1e-7)


def test_tk_optimize_splits_on_request_and_checkpoints_are_exact_masters(monkeypatch):
    with_bf16(monkeypatch)
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, split_master_weight_for_bf16=True,
                            sample_input=data()[0], time_budget=0)
    assert fast.kiln_recipe.master_weights == "split"
    assert "split master weights" in " ".join(fast.kiln_report.applied)
    assert fast.kiln_report.guard["ok"]
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    x, y = data()
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(fast(x), y).backward()
        opt.step()
    sd = fast.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert not torch.equal(sd["0.weight"], sd["0.weight"].bfloat16().float())  # the trails are in it
    # Both ways: into a plain model and a stock optimizer, and back.
    plain = net()
    plain.load_state_dict(sd)
    stock = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    stock.load_state_dict(opt.state_dict())
    assert all(v.dtype == torch.float32 for st in stock.state.values() for v in st.values())
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1e-3)
    fast.load_state_dict(plain.state_dict())
    opt.load_state_dict(stock.state_dict())
    assert model[0].weight.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(fast.state_dict().values(), plain.state_dict().values(), strict=True))
    assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values() if v.dim())
    # A copy has no optimizer to keep trails in: it carries the exact float32 masters.
    buf = io.BytesIO()
    torch.save(fast.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    for copied in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert copied.kiln_recipe.master_weights == "fp32"
        assert all(torch.equal(a, b) for a, b in zip(copied.state_dict().values(), loaded.values(), strict=True))


def test_a_parent_saves_and_loads_the_exact_masters(monkeypatch):
    with_bf16(monkeypatch)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, split_master_weight_for_bf16=True,
                            sample_input=data()[0], time_budget=0)
    parent = nn.ModuleDict({"net": fast})
    source = net()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1e-3)  # float32 values a bf16 weight cannot hold
    parent.load_state_dict({"net." + k: v for k, v in source.state_dict().items()})
    assert model[0].weight.dtype == torch.bfloat16
    for (k, got), want in zip(parent.state_dict().items(), source.state_dict().values(), strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want), k


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_the_pair_copied_together_trains_the_copy(monkeypatch, how):
    # the model was copied with a memo of its own: the copied optimizer then trained parameters the
    # copied model did not hold, and the copy never changed
    with_bf16(monkeypatch)
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=torch.bfloat16,
                            split_master_weight_for_bf16=True, sample_input=data()[0], time_budget=0)
    x, y = data()
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(fast(x), y).backward()
        opt.step()
    masters = {k: v.clone() for k, v in fast.state_dict().items()}
    if how == "deepcopy":
        twin, twin_opt = copy.deepcopy((fast, opt))
    else:
        buf = io.BytesIO()
        torch.save({"model": fast, "opt": opt}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        twin, twin_opt = saved["model"], saved["opt"]
    held = {id(p) for p in twin.parameters()}
    assert all(id(p) in held for g in twin_opt.param_groups for p in g["params"])
    assert all(torch.equal(a, masters[k]) for k, a in twin.state_dict().items())  # the exact masters
    twin_opt.zero_grad()
    nn.functional.cross_entropy(twin(x), y).backward()
    twin_opt.step()
    assert any(not torch.equal(a, masters[k]) for k, a in twin.state_dict().items())
    assert all(torch.equal(a, masters[k]) for k, a in fast.state_dict().items())  # the original untouched


def test_split_is_not_the_default_and_bad_values_are_refused(monkeypatch):
    class Clipping(torch.optim.SGD):  # might read every gradient at once: not stepped in chunks
        pass

    with_bf16(monkeypatch)
    model = net()
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)
    assert fast.kiln_recipe.master_weights == "fp32"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model = net()
    with pytest.raises(ValueError, match="split_master_weight_for_bf16='yes'"):
        tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                    split_master_weight_for_bf16="yes")
    model = net()  # float32 training: nothing to split, and the recipe says why
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          split_master_weight_for_bf16=True)
    assert fast.kiln_recipe.master_weights == "fp32"
    assert any("not bfloat16" in n for n in fast.kiln_recipe.notes)
    model = net()
    fast, _ = tk.optimize(model, optimizer=Clipping(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                          split_master_weight_for_bf16=True)
    assert fast.kiln_recipe.master_weights == "fp32"
    assert any("Clipping is not one of" in n for n in fast.kiln_recipe.notes)
    assert all(p.dtype == torch.float32 for p in model.parameters())


class MixesDtypes(nn.Module):
    """Runs its head outside autocast on float32 inputs: fine with float32 weights only."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.a(x)).float()
        with torch.autocast(x.device.type, enabled=False):
            return self.b(h)


def test_a_model_that_fails_with_bf16_weights_trains_with_float32_ones(monkeypatch):
    with_bf16(monkeypatch)
    torch.manual_seed(0)
    model = MixesDtypes().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, split_master_weight_for_bf16=True,
                            graph_mode=False)
    assert model.b.weight.dtype == torch.bfloat16
    x, y = data()
    with pytest.warns(UserWarning, match="split weights"):
        out = fast(x)
    assert [f.step for f in fast.kiln_report.fallbacks] == ["split master weights"]
    assert fast.kiln_recipe.master_weights == "fp32"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # The masters came back exactly: the first output equals the untouched copy's under autocast.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    nn.functional.cross_entropy(out, y).backward()
    opt.step()  # the optimizer's own step again, on float32 parameters
    assert "step" not in vars(opt)


def test_a_bad_input_is_the_callers_error_and_the_split_stays(monkeypatch):
    with_bf16(monkeypatch)
    model = net()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                            split_master_weight_for_bf16=True, graph_mode=False)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        fast(torch.randn(4, 31))
    assert fast.kiln_recipe.master_weights == "split" and not fast.kiln_report.fallbacks
    assert model[0].weight.dtype == torch.bfloat16
    x, y = data()
    nn.functional.cross_entropy(fast(x), y).backward()
    opt.step()
    assert model[0].weight.dtype == torch.bfloat16 and fast.state_dict()["0.weight"].dtype == torch.float32
