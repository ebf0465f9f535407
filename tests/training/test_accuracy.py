"""Real data: scikit-learn's digits (1797 8x8 images shipped with the package).
Trained in bf16 through torchkiln, a model reaches fp32 eager's test accuracy
within 1 point; so does a small channels_last CNN with BatchNorm trained the way
the IPEX articles train ResNet-50."""

import copy

import pytest
import torch
from torch import nn

import torchkiln as tk

from .test_training import with_bf16

datasets = pytest.importorskip("sklearn.datasets")


def digits():
    d = datasets.load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 10))


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 16, 10))


def fit(model, opt, train, epochs, channels_last, autocast_dtype=None):
    x, y = train
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    for _ in range(epochs):
        for i in range(0, len(y), 64):
            opt.zero_grad()
            # The loop as the articles write it (autocast in the loop is harmless under torchkiln).
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                loss = nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64])
            loss.backward()
            opt.step()


def accuracy(model, test) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(test[0]).argmax(-1) == test[1]).float().mean())


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_bf16_through_torchkiln_within_one_point_of_fp32(kind, monkeypatch):
    with_bf16(monkeypatch)
    train, test = digits()
    make, epochs, cl = (mlp, 8, False) if kind == "mlp" else (cnn, 3, True)
    ref = make().train()
    if cl:
        ref = ref.to(memory_format=torch.channels_last)
    model = copy.deepcopy(ref)
    fit(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), train, epochs, cl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, sample_input=train[0][:64], time_budget=0)
    assert fast.kiln_recipe.precision == "autocast"
    fit(fast, opt, train, epochs, cl, autocast_dtype=torch.bfloat16)
    acc_ref, acc = accuracy(ref, test), accuracy(fast, test)
    assert acc_ref > 0.9  # the reference itself learnt the task
    assert acc >= acc_ref - 0.01, (acc, acc_ref)
