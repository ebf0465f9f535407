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

pytest.importorskip("sklearn.datasets")
from digits import accuracy, cnn, digits, fit  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 10))


@pytest.mark.parametrize("split", [False, True], ids=["autocast", "split-masters"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_bf16_through_torchkiln_within_one_point_of_fp32(kind, split, monkeypatch):
    with_bf16(monkeypatch)
    train, test = digits()
    make, epochs, cl = (mlp, 8, False) if kind == "mlp" else (cnn, 3, True)
    ref = make().train()
    if cl:
        ref = ref.to(memory_format=torch.channels_last)
    model = copy.deepcopy(ref)
    fit(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), train, epochs, cl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, sample_input=train[0][:64], time_budget=0,
                            split_master_weight_for_bf16=split)
    assert fast.kiln_recipe.precision == "autocast"
    assert fast.kiln_recipe.master_weights == ("split" if split else "fp32")
    fit(fast, opt, train, epochs, cl, autocast_dtype=torch.bfloat16)
    acc_ref, acc = accuracy(ref, test), accuracy(fast, test)
    assert acc_ref > 0.9  # the reference itself learnt the task
    assert acc >= acc_ref - 0.01, (acc, acc_ref)
