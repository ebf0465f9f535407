import copy

import pytest
import torch
from torch import nn

from torchkiln.passes import registry
from torchkiln.passes.pad_conv_channels import PadConvChannelsConfig, PaddedConv2d, pad_conv_channels

CTX = registry.PassContext(torch.device("cpu"), torch.float32)


def stem_net(bias=True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 5, stride=2, padding=2, bias=bias), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()


@pytest.mark.parametrize("multiple", [4, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_padded_stem_computes_the_unpadded_convolution(multiple, bias):
    m = stem_net(bias)
    x = torch.randn(2, 3, 20, 20)
    ref = m(x)  # the model as given, before the pass
    out, names = pad_conv_channels(stem_net(bias), multiple)
    assert names == ["0"] and type(out[0]) is PaddedConv2d
    assert out[0].weight.shape == (8, multiple, 5, 5) and out[0].weight[:, 3:].abs().sum() == 0
    assert type(out[2]) is nn.Conv2d  # 8 channels: left alone
    with torch.no_grad():
        torch.testing.assert_close(out(x), ref, rtol=1e-5, atol=1e-6)
        cl = x.contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(out(cl), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[0](x[0]), m[0](x[0]), rtol=1e-5, atol=1e-6)  # unbatched (C, H, W)


def test_padded_stem_in_bfloat16_matches_within_rounding():
    m = stem_net().to(torch.bfloat16)
    x = torch.randn(2, 3, 20, 20, dtype=torch.bfloat16)
    out, _ = pad_conv_channels(stem_net().to(torch.bfloat16))
    with torch.no_grad():
        ref = m.float()(x.float())
        torch.testing.assert_close(out(x).float(), ref, rtol=2e-2, atol=2e-2)


def test_the_callers_conv_keeps_its_weight():
    m = stem_net()
    w = m[0].weight
    before = w.detach().clone()
    c = copy.copy(m)  # a shallow copy shares the Parameters, as optimize()'s copy does
    c._modules = dict(m._modules)
    pad_conv_channels(c)
    assert m[0] is not c[0] and m[0].weight is w and w.shape == (8, 3, 5, 5)
    assert torch.equal(w, before)
    assert c[0].bias is m[0].bias  # the bias is not padded: shared


@pytest.mark.parametrize("conv", [
    nn.Conv2d(8, 8, 3),  # already a multiple
    nn.Conv2d(2, 4, 3, groups=2),  # grouped
    nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"),  # would pad the zero channels' reflection too
    type("WS", (nn.Conv2d,), {})(3, 8, 3),  # a subclass may change forward
    nn.Conv1d(3, 8, 3),
], ids=["four", "grouped", "reflect", "subclass", "conv1d"])
def test_ineligible_convs_are_left_alone(conv):
    m = nn.Sequential(conv)
    out, names = pad_conv_channels(m)
    assert names == [] and out[0] is conv


def test_a_hooked_conv_is_left_alone():
    m = stem_net()
    m[0].register_forward_hook(lambda mod, i, o: None)
    assert pad_conv_channels(m)[1] == []


def test_registered_pass_notes_what_it_padded():
    info = registry.lookup("pad_conv_channels")
    out, note = info.apply(stem_net(), PadConvChannelsConfig(), CTX)
    assert note == "0 3->8 input channels" and type(out[0]) is PaddedConv2d
    _, note = info.apply(nn.Sequential(nn.Linear(2, 2)), PadConvChannelsConfig(multiple=4), CTX)
    assert note == "no convolution of few input channels"
