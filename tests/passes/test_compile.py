import torch
import torch._inductor.config as inductor_config
from torch import nn

from torchkiln.passes import compile_model


def test_matches_eager_and_leaves_global_config_alone():
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).eval()
    x = torch.randn(3, 16)
    before = inductor_config.freezing
    c = compile_model(m, {"freezing": True}, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert inductor_config.freezing == before
