"""training/probe.py: the proxy loss the training guard and timing backpropagate."""

import torch

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
