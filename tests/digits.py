"""scikit-learn's digits (1797 8x8 images shipped with the package): the data split, a small
CNN with BatchNorm, the training loop as the IPEX articles write it, and test accuracy. Shared by
the training and quantization accuracy tests."""

import torch
from sklearn import datasets
from torch import nn


def digits():
    d = datasets.load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


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
