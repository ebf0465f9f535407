"""passes/global_avg_pool.py: an average pool over its whole input becomes a mean in the compiled
graph (and in an exported ATen graph, as the int8 flow's), against eager on the same inputs; a pool
whose window does not cover its input is left alone; the CPU plan takes the pass for models holding
an AvgPool2d."""

import warnings

import needs
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor import config as inductor_config

import torchkiln as tk
from torchkiln.hardware import detect
from torchkiln.passes.global_avg_pool import GlobalAvgPoolPass, has_avg_pool, rewrite
from torchkiln.plan import plan


class Pooled(nn.Module):
    def __init__(self, pool: nn.Module):
        super().__init__()
        self.conv, self.pool, self.fc = nn.Conv2d(3, 16, 3, padding=1), pool, nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(F.relu(self.conv(x))), 1))


def compiled(model, x):
    hook = GlobalAvgPoolPass()
    torch._dynamo.reset()
    # no FX graph cache: on a hit the pass does not run (its graph is cached), and this counts its rewrites
    with torch.no_grad(), inductor_config.patch({"pre_grad_custom_pass": hook, "fx_graph_cache": False}):
        got = torch.compile(model)(x)
    return got, hook.fused


def test_a_window_past_the_input_is_a_mean_in_the_compiled_graph():
    # transformers' EfficientNet pools so: AvgPool2d(hidden_dim, ceil_mode=True) on a 7 x 7 map
    for pool in (nn.AvgPool2d(1280, ceil_mode=True), nn.AvgPool2d(7), nn.AvgPool2d((9, 7), ceil_mode=True)):
        model, x = Pooled(pool).eval(), torch.randn(2, 3, 7, 7)
        with torch.no_grad():
            want = model(x)
        got, fused = compiled(model, x)
        assert fused == 1, pool
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_pool_that_does_not_cover_its_input_is_left_alone():
    for pool in (nn.AvgPool2d(3), nn.AvgPool2d(7, padding=1), nn.AvgPool2d(7, divisor_override=2)):
        model, x = Pooled(pool).eval(), torch.randn(2, 3, 8, 8)
        if isinstance(pool, nn.AvgPool2d) and pool.kernel_size == 3:
            model.fc = nn.Linear(16 * 4, 4)
        with torch.no_grad():
            want = model(x)
        got, fused = compiled(model, x)
        assert fused == 0, pool
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_aten_form_of_an_exported_graph_is_rewritten():
    model, x = Pooled(nn.AvgPool2d(1280, ceil_mode=True)).eval(), torch.randn(2, 3, 7, 7)
    gm = torch.export.export(model, (x,), strict=False).module()
    assert any(n.target is torch.ops.aten.avg_pool2d.default for n in gm.graph.nodes)
    assert rewrite(gm.graph) == 1
    gm.recompile()
    assert not any(n.target is torch.ops.aten.avg_pool2d.default for n in gm.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


def test_the_plan_takes_it_only_for_a_model_with_an_avg_pool():
    def recipe(pool):
        return plan(Pooled(pool).eval(), detect(), "cpu", torch.float32, "O1", {}, None)

    with_pool, without = recipe(nn.AvgPool2d(1280, ceil_mode=True)), recipe(nn.AdaptiveAvgPool2d(1))
    assert "global_avg_pool" in [p.name for p in with_pool.passes]
    assert "global_avg_pool" not in [p.name for p in without.passes]


@needs.pt2e
def test_a_quantized_model_with_the_pool_gets_it_in_its_compiled_recipe():
    """The int8 graph holds the pool as an avg_pool2d call, not a module (EfficientNet int8's compiled
    candidate: 237 -> 4.3 ms at bs1 with it)."""
    x = torch.randn(2, 3, 7, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pool, want in ((nn.AvgPool2d(1280, ceil_mode=True), True), (nn.AdaptiveAvgPool2d(1), False)):
            q = tk.quantize(Pooled(pool).eval(), "int8-static", calib_data=[torch.randn(2, 3, 7, 7)] * 2,
                            progress=False)
            assert has_avg_pool(q) is want
            served = tk.optimize(q, sample_input=x, time_budget=0.2)
            assert ("global_avg_pool" in [p.name for p in served.kiln_recipe.passes]) is want
            with torch.no_grad():
                torch.testing.assert_close(served(x), q(x), rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
def test_the_mean_matches_eager_on_cuda():
    model, x = Pooled(nn.AvgPool2d(1280, ceil_mode=True)).eval().cuda(), torch.randn(2, 3, 7, 7, device="cuda")
    with torch.no_grad():
        want = model(x)
    got, fused = compiled(model, x)
    assert fused == 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
