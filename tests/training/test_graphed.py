"""The CUDA-graphed training step (training/graphed.py) against the same model trained eagerly.
Skipped without a GPU; run on the H200 whenever that code changes (docs/gpu.md)."""

import copy

import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.training.graphed import GraphedStep

pytestmark = pytest.mark.cuda
TOL = dict(rtol=1e-5, atol=1e-6)  # float32, the same kernels replayed: only reduction order may differ


def pair(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4)).cuda().train()
    ref = copy.deepcopy(model)
    return model, GraphedStep(model, model, torch.device("cuda")), ref


def batch(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(8, 16, device="cuda", generator=g), torch.randint(0, 4, (8,), device="cuda", generator=g)


def loss_of(fn, x, y):
    return nn.functional.cross_entropy(fn(x), y)


def test_steps_replay_a_graph_and_train_as_eager():
    model, step, ref = pair()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    for i in range(6):
        x, y = batch(i)
        for fn, o in ((step, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            loss_of(fn, x, y).backward()
            o.step()
    assert step._entry is not None, "no graph was captured"
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_accumulation_sums_each_micro_batch_once(set_to_none):
    # torch.cuda.make_graphed_callables hands autograd the graph's own gradient buffers: a second backward
    # replays into the .grad it accumulates into, and the sum came out as twice the last micro-batch
    model, step, ref = pair(1)
    for rounds in range(2):
        for m in (model, ref):
            m.zero_grad(set_to_none=set_to_none)
        for i in range(3):
            x, y = batch(10 * rounds + i)
            loss_of(step, x, y).backward()
            loss_of(ref, x, y).backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL)
    assert step._entry is not None


def test_a_kept_output_keeps_its_value_and_two_forwards_before_their_backwards_are_right():
    model, step, ref = pair(2)
    (x1, y1), (x2, y2) = batch(1), batch(2)
    loss_of(step, x1, y1).backward()  # the first call captures
    assert step._entry is not None
    model.zero_grad(set_to_none=True)
    first = loss_of(step, x1, y1)
    value = first.item()
    second = loss_of(step, x2, y2)  # while first's backward is owed: runs without the graph
    assert first.item() == value
    second.backward()
    first.backward()
    ref_grads = torch.autograd.grad(loss_of(ref, x1, y1) + loss_of(ref, x2, y2), list(ref.parameters()))
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g, **TOL)


def test_other_call_forms_run_without_the_graph():
    model, step, ref = pair(3)
    x, y = batch(3)
    loss_of(step, x, y).backward()
    assert step._entry is not None
    big = torch.randn(32, 16, device="cuda")  # another shape: a replay would fail to copy it in
    torch.testing.assert_close(step(big), ref(big), **TOL)
    with torch.no_grad():  # a weight replaced, not written in place: a replay would read the old address
        model[0].weight.data = model[0].weight.data * 2
        ref[0].weight.data = ref[0].weight.data * 2
    torch.testing.assert_close(step(x), ref(x), **TOL)


def test_eval_mode_calls_run_without_the_training_graph():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 4)).cuda().train()
    step = GraphedStep(model, model, torch.device("cuda"))
    x, y = batch(5)
    loss_of(step, x, y).backward()
    assert step._entry is not None
    model.eval()  # a replay would apply the captured dropout
    torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)


def test_a_backward_whose_forward_was_replayed_over_raises():
    model, step, _ = pair(4)
    (x1, y1), (x2, y2) = batch(1), batch(2)
    loss_of(step, x1, y1).backward()
    first = loss_of(step, x1, y1)
    first.backward(retain_graph=True)
    loss_of(step, x2, y2).backward()
    with pytest.raises(RuntimeError, match="replayed over"):
        first.backward()


def test_optimize_times_the_graphed_step_and_trains_as_autocast_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10)).cuda().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, sample_input=x, time_budget=0.5)
    graphed = next(m for m in fast.kiln_report.candidates if "CUDA graphs" in m.name)
    assert graphed.status in ("served", "passed"), graphed.reason
    for m, o, ac in ((fast, opt, False), (ref, ref_opt, True)):
        for _ in range(5):
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac):
                loss = nn.functional.cross_entropy(m(x).float(), y)
            loss.backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)
