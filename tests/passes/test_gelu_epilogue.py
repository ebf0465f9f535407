"""gelu_epilogue: the graph rewrite (CPU: the op runs the pattern as written) and its registry hook.
The cuBLASLt numerics are tested on a GPU in tests/test_cuda.py."""

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn

from torchkiln.passes import registry
from torchkiln.passes.gelu_epilogue import GeluEpiloguePass


class Block(nn.Module):
    def __init__(self, bias=True, approximate="none", reuse=False):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64, bias=bias), nn.Linear(64, 16)
        self.approximate, self.reuse = approximate, reuse

    def forward(self, x):
        h = self.up(x)
        y = self.down(F.gelu(h, approximate=self.approximate))
        return y + h[..., :16] if self.reuse else y  # reuse: the GEMM output has another user


@pytest.mark.parametrize("kw,fused", [({}, 1), ({"approximate": "tanh"}, 1), ({"bias": False}, 0),
                                      ({"reuse": True}, 0)])
def test_fuses_gelu_of_a_biased_linear_with_no_other_user(kw, fused):
    torch.manual_seed(0)
    m, x = Block(**kw).eval(), torch.randn(3, 5, 16)
    p = GeluEpiloguePass()
    # no FX graph cache: on a hit the pass does not run (its graph is cached), and this counts its rewrites
    with torch.no_grad(), inductor_config.patch({"pre_grad_custom_pass": p, "fx_graph_cache": False}):
        out = torch.compile(m, backend="inductor")(x)
        ref = m(x)
    assert p.fused == fused
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_graph_pass_comes_from_the_recipe_configs():
    assert registry.graph_pass([registry.make("cast_dtype", dtype="bfloat16")]) is None
    p = registry.graph_pass([registry.make("cast_dtype", dtype="bfloat16"), registry.make("gelu_epilogue")])
    assert isinstance(p, GeluEpiloguePass)
    assert registry.run_pass("gelu_epilogue", nn.Linear(2, 2))[1] == "in the compiled graph"


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradients_flow_through_the_fused_op(approximate):
    """Served models are for inference, but a gradient to the input works in eager, so it must here."""
    torch.manual_seed(0)
    m = Block(approximate=approximate)
    x = torch.randn(3, 5, 16, requires_grad=True)
    p = GeluEpiloguePass()
    with inductor_config.patch({"pre_grad_custom_pass": p, "fx_graph_cache": False}):
        torch.compile(m, backend="inductor")(x).square().sum().backward()
    assert p.fused == 1
    got = (x.grad.clone(), m.up.weight.grad.clone(), m.up.bias.grad.clone())
    x.grad = None
    m.zero_grad()
    m(x).square().sum().backward()
    for g, r in zip(got, (x.grad, m.up.weight.grad, m.up.bias.grad), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_only_a_compiled_candidate_reports_the_graph_pass():
    # The eager-passes candidate shares the compiled one's build (and its list of passes that ran), but
    # runs no graph: it must not report gelu_epilogue as applied.
    from torchkiln.candidates import applied_for, candidates
    from torchkiln.recipe import Recipe

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval()
    rec = Recipe(device="cpu", dtype="float32", compile=True,
                 passes=(registry.make("gelu_epilogue"),))
    cands = {c.name: c for c in candidates(model, rec, None, False, "auto", [])}
    eager = next(c for n, c in cands.items() if n.startswith("torchkiln eager passes"))
    compiled = next(c for n, c in cands.items() if n.startswith("torchkiln compiled"))
    eager.make()(torch.randn(2, 8))  # builds the shared runner: the module-level step records the pass
    assert any(a.startswith("gelu_epilogue") for a in compiled.applied)
    assert any(a.startswith("gelu_epilogue") for a in applied_for(compiled))
    assert not any(a.startswith("gelu_epilogue") for a in applied_for(eager))
