import torch
from torch import nn

from torchkiln.passes import channels_last, memory_format_for


def test_conv_weights_become_channels_last_and_numerics_hold():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    x = torch.randn(2, 3, 16, 16)
    ref = m(x)
    out = channels_last(m)
    assert out[0].weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out(x.contiguous(memory_format=torch.channels_last)), ref, rtol=1e-4, atol=1e-5)


def test_format_choice():
    assert memory_format_for(nn.Linear(2, 2)) is None
    assert memory_format_for(nn.Conv3d(1, 1, 1)) == torch.channels_last_3d
    assert memory_format_for(nn.Conv2d(1, 1, 1)) == torch.channels_last
