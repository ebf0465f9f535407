"""training/graphs.py on the CPU: a stand-in for graph trees' pool shows the hazards it guards.

A CUDA graph's outputs are views of one pool that the next replay rewrites. ``Pooled`` does the same
on the CPU: its forward returns a view of one output buffer and its backward writes the weight's
gradient into one gradient buffer and returns a fresh view of it, which autograd's AccumulateGrad
takes as ``.grad`` itself (no copy), as it does with a replayed backward's output. References are
computed with plain autograd on separate leaves.
"""

import pytest
import torch
from torch import nn

from torchkiln.training.graphs import GraphedStep


class Pooled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, pool):
        ctx.save_for_backward(x, w)
        ctx.pool = pool
        y = pool["out"][: x.shape[0] * w.shape[0]].view(x.shape[0], w.shape[0])
        y.copy_(x @ w.t())
        return y

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        buf = ctx.pool["grad"]
        buf.copy_((go.t() @ x).flatten())
        return go @ w, buf.view(w.shape), None


def setup():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    pool = {"out": torch.empty(64), "grad": torch.empty(12)}
    xs = [torch.randn(2, 4) for _ in range(3)]
    return w, pool, xs


def reference_grad(w, xs):
    leaf = w.detach().clone().requires_grad_()
    for x in xs:
        (leaf @ x.t()).t().pow(2).sum().backward()
    return leaf.grad


def test_the_stand_in_shows_the_hazard_unguarded():
    # Without the wrapper, the second backward rewrites the .grad autograd took from the first: the
    # accumulated gradient is twice the last micro-batch's, not the sum (pytorch/pytorch#96693's form).
    w, pool, xs = setup()
    for x in xs[:2]:
        Pooled.apply(x, w, pool).pow(2).sum().backward()
    assert not torch.allclose(w.grad, reference_grad(w, xs[:2]), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(w.grad, 2 * reference_grad(w, xs[1:2]))


def test_gradients_accumulated_over_micro_batches_equal_autograds():
    w, pool, xs = setup()
    step = GraphedStep(lambda x: Pooled.apply(x, w, pool), [w])
    for x in xs:
        step(x).pow(2).sum().backward()
    torch.testing.assert_close(w.grad, reference_grad(w, xs), rtol=1e-6, atol=1e-6)


def test_a_loop_that_sets_gradients_to_none_copies_nothing():
    w, pool, xs = setup()
    step = GraphedStep(lambda x: Pooled.apply(x, w, pool), [w])
    for x in xs:
        w.grad = None
        assert step.own_grads() == 0
        step(x).pow(2).sum().backward()
        torch.testing.assert_close(w.grad, reference_grad(w, [x]), rtol=1e-6, atol=1e-6)


def test_zero_grad_in_place_copies_once_then_accumulates_into_the_copy():
    w, pool, xs = setup()
    step = GraphedStep(lambda x: Pooled.apply(x, w, pool), [w])
    opt = torch.optim.SGD([w], lr=0.0)  # lr 0: only its zero_grad(set_to_none=False) is used
    copies = []
    for x in xs:
        opt.zero_grad(set_to_none=False)
        copies.append(step.own_grads())
        step(x).pow(2).sum().backward()
        torch.testing.assert_close(w.grad, reference_grad(w, [x]), rtol=1e-6, atol=1e-6)
    assert copies == [0, 1, 0]  # none yet, then the pooled .grad once, then the copy is kept


@pytest.mark.parametrize("detach", [False, True])
def test_outputs_kept_past_the_next_call_keep_their_values(detach):
    w, pool, xs = setup()
    step = GraphedStep(lambda x: Pooled.apply(x, w, pool), [w])
    first = step(xs[0])
    kept = first.detach() if detach else first
    step(xs[1])
    torch.testing.assert_close(kept, (xs[0] @ w.t()).detach())
    assert kept.untyped_storage().data_ptr() != pool["out"].untyped_storage().data_ptr()
