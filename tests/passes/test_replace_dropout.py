import torch
from torch import nn

from torchkiln.passes import replace_dropout


def test_all_dropouts_become_identity_and_eval_output_is_unchanged():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Sequential(nn.Dropout1d(0.3), nn.ReLU()),
                      nn.AlphaDropout(0.2)).eval()
    x = torch.randn(3, 4)
    ref = m(x)
    out = replace_dropout(m)
    kinds = {type(x) for x in out.modules()}
    assert not kinds & {nn.Dropout, nn.Dropout1d, nn.AlphaDropout}
    assert nn.Identity in kinds
    torch.testing.assert_close(out(x), ref, rtol=0, atol=0)
