"""training/probe.py: the proxy loss the training guard and timing backpropagate."""

import dataclasses

import torch
from torch import nn

from torchkiln.training import probe


def test_projection_is_drawn_once_per_block_and_matches_a_fresh_draw():
    out = (torch.randn(4, 5, requires_grad=True), torch.randn(3, requires_grad=True))
    cache = {}
    first = probe.proxy_loss(out, cache=cache)
    drawn = {k: v for k, v in cache.items()}
    assert len(drawn) == 2 and all(w.device == out[0].device for w in drawn.values())
    second = probe.proxy_loss(out, cache=cache)
    assert all(cache[k] is drawn[k] for k in drawn)  # reused, not drawn again
    # The reference: the same projection computed by hand from the same seeds.
    by_hand = sum((t * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))).sum()
                  for i, t in enumerate(out))
    torch.testing.assert_close(first, by_hand)
    torch.testing.assert_close(second, by_hand)
    torch.testing.assert_close(probe.proxy_loss(out), by_hand)  # no cache: the same numbers


def test_no_trainable_output_gives_none():
    assert probe.proxy_loss((torch.randn(3), torch.arange(3))) is None


@dataclasses.dataclass
class Out:  # a model's own output class with a loss field, as transformers' outputs have
    loss: torch.Tensor
    logits: torch.Tensor


def test_timing_steps_backpropagate_the_models_own_loss_and_comparing_steps_every_output():
    # keep=False (timing) follows out.loss as the user's loop does; keep=True (the guard) needs every
    # output's gradient: the logits' projection reaches the head's weight where the loss does not.
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.body(x)
            return Out(loss=h.pow(2).mean(), logits=self.head(h.detach()))

    torch.manual_seed(0)
    m = WithLoss()
    params = probe.trainable(m)
    x = torch.randn(3, 4)
    probe.step(m, params, (x,), {}, keep=False)
    assert m.head.weight.grad is None and m.body.weight.grad is not None
    want = torch.autograd.grad(m.body(x).pow(2).mean(), m.body.weight)[0]
    torch.testing.assert_close(m.body.weight.grad, want)
    probe.step(m, params, (x,), {}, keep=True)
    assert m.head.weight.grad is not None
