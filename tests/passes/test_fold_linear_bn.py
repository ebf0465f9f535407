import copy

import torch
from torch import nn

from torchkiln.passes.registry import run_pass


def test_folds_and_matches_eager():
    bn = nn.BatchNorm1d(16)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    m = nn.Sequential(nn.Linear(8, 16), bn, nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(5, 8)
    ref = m(x)
    out, note = run_pass("fold_linear_bn", copy.deepcopy(m))
    assert isinstance(out[1], nn.Identity) and note == "1 folded"
    torch.testing.assert_close(out(x), ref, rtol=1e-5, atol=1e-5)


def test_bn_over_other_axis_is_not_folded():
    # Linear(8->6) on (N, 4, 8) then BatchNorm1d(4) normalises axis 1, not the features.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 6)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.fc(x))

    m = M().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
    x = torch.randn(2, 4, 8)
    ref = m(x)
    out, note = run_pass("fold_linear_bn", m)
    assert isinstance(out.bn, nn.BatchNorm1d) and note == "0 folded"
    torch.testing.assert_close(out(x), ref, rtol=1e-5, atol=1e-5)
