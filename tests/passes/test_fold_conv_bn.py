import copy

import pytest
import torch
from torch import nn

from torchkiln.passes import fold_conv_bn
from torchkiln.passes.registry import run_pass


def _bn(n, dim):
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dim](n).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("transpose", [False, True])
def test_folds_and_matches_eager(dim, transpose):
    conv = getattr(nn, f"Conv{'Transpose' if transpose else ''}{dim}d")(4, 8, 3)
    model = nn.Sequential(conv, _bn(8, dim), nn.ReLU()).eval()
    x = torch.randn(2, 4, *([6] * dim))
    ref = model(x)
    import copy

    folded, note = run_pass("fold_conv_bn", copy.deepcopy(model))
    assert isinstance(folded[1], nn.Identity) and note == "1 folded"
    torch.testing.assert_close(folded(x), ref, rtol=1e-5, atol=1e-5)


class Residual(nn.Module):
    """conv output feeds the BN *and* the residual: folding would change the residual."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = _bn(4, 2)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def test_shared_output_is_not_folded():
    m = Residual().eval()
    x = torch.randn(1, 4, 5, 5)
    ref = m(x)
    out, note = run_pass("fold_conv_bn", m)
    assert isinstance(out.bn, nn.BatchNorm2d) and note == "0 folded"
    torch.testing.assert_close(out(x), ref)


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), _bn(4, 2))

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: fx cannot trace this
            return self.body(x)
        return self.body(-x)


def test_untraceable_model_folds_inside_sequential():
    m = Untraceable().eval()
    x = torch.randn(1, 3, 6, 6)
    ref = m(x)
    out = fold_conv_bn(m)
    assert isinstance(out.body[1], nn.Identity)
    torch.testing.assert_close(out(x), ref, rtol=1e-5, atol=1e-5)


def test_batch_stats_bn_is_left_alone():
    bn = nn.BatchNorm2d(4, track_running_stats=False)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), bn).eval()
    assert isinstance(fold_conv_bn(m)[1], nn.BatchNorm2d)


def test_a_bf16_model_folds_in_float32():
    """Folded weights are rounded to bf16 once: 8 conv+BN layers with BN far from identity keep the
    model's own bf16 error against float32 (0.0021 -> 0.0023 here; folded in bf16 it was 0.0070)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        bn = nn.BatchNorm2d(32)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.05, 4)
        bn.weight.data.uniform_(0.5, 2)
        bn.bias.data.uniform_(-1, 1)
        layers += [nn.Conv2d(32, 32, 3, padding=1), bn, nn.ReLU()]
    half = nn.Sequential(*layers).eval().bfloat16()
    x = torch.randn(2, 32, 16, 16)
    with torch.no_grad():
        truth = copy.deepcopy(half).float()(x)
        own = float((half(x.bfloat16()).float() - truth).norm() / truth.norm())
        folded = fold_conv_bn(copy.deepcopy(half))
        assert folded[0].weight.dtype == torch.bfloat16 and not any(isinstance(m, nn.BatchNorm2d) for m in folded)
        err = float((folded(x.bfloat16()).float() - truth).norm() / truth.norm())
    assert err < 1.5 * own, (err, own)
