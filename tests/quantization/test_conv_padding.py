"""quantization/conv_padding.py: a convolution's padding string ("same" / "valid") restated as numbers
in an exported graph, against the eager model; an even kernel's "same" (one side padded more) left as
it is; and the pt2e int8 flow taking a "same"-padded model, which torchao's quantizer refused before."""

import warnings

import needs
import torch
from torch import nn

import torchkiln as tk
from torchkiln.quantization.conv_padding import numeric_conv_padding


class Padded(nn.Module):
    def __init__(self, even: bool = False):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding="same")
        self.b = nn.Conv2d(8, 8, 5, padding="same", dilation=2, groups=8)
        self.c = nn.Conv2d(8, 8, 3, padding="valid")
        self.d = nn.Conv2d(8, 8, 2, padding="same") if even else nn.Identity()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.d(self.c(torch.relu(self.b(torch.relu(self.a(x))))))
        return self.head(x.mean((2, 3)))


def padding_ops(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.conv2d.padding]


def test_padding_strings_become_numbers_with_the_same_output():
    for even in (False, True):
        model, x = Padded(even).eval(), torch.randn(2, 3, 11, 13)
        gm = torch.export.export(model, (x,), strict=False).module()
        assert len(padding_ops(gm)) == 3 + even
        assert numeric_conv_padding(gm) == 3
        assert len(padding_ops(gm)) == int(even)  # the even kernel's "same" stays a string
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


@needs.pt2e
def test_the_int8_flow_takes_a_same_padded_model():
    model, x = Padded().eval(), torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = tk.quantize(model, "int8-static", calib_data=[torch.randn(2, 3, 16, 16) for _ in range(4)],
                        progress=False)
    with torch.no_grad():
        ref, got = model(x), q(x)
    assert float((got - ref).norm() / ref.norm()) < 0.1
