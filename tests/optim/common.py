"""Shared by the Lamb and Lars tests: a small model, data, one clipped backward, and the
save-and-resume check."""

import io

import torch
from torch import nn


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4)).to(dtype)


def batches(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g).to(dtype), torch.randn(32, 4, generator=g).to(dtype))
            for _ in range(n)]


def backward(model, x, y, max_norm=0.5):
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def assert_resume_is_exact(setup, data, state_keys: set) -> None:
    """Train, save (model, optimizer, scheduler), train on; a fresh setup loaded from the save
    and trained on the same batches lands on bit-identical weights."""

    def train(model, opt, sched, chunk):
        for x, y in chunk:
            backward(model, x, y)
            opt.step()
            sched.step()

    model, opt, sched = setup()
    train(model, opt, sched, data[:10])
    buf = io.BytesIO()  # through torch.save: loaded state must not share tensors with the live one
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    train(model, opt, sched, data[10:])
    buf.seek(0)
    ckpt = torch.load(buf)
    model2, opt2, sched2 = setup()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert set(opt2.state[next(model2.parameters())]) == state_keys
    train(model2, opt2, sched2, data[10:])
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
