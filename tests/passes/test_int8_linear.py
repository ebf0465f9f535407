"""passes/int8_linear.py: a pt2e int8 graph's linears rewritten onto torchkiln::qlinear_u8, checked
against the pt2e graph itself (float math on the dequantized values), in eager and compiled by
tk.optimize; the patterns it must leave alone; and the plan taking it."""

from __future__ import annotations

import copy
import warnings

import needs
import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.kernels import cpu_qlinear
from torchkiln.passes.int8_linear import rewrite

pytestmark = [needs.pt2e, needs.int8_dot_cpu,
              pytest.mark.skipif(cpu_qlinear.load() is not None, reason=f"{cpu_qlinear.load()}")]


class Block(nn.Module):
    """A transformer layer's linears: a projection, an FFN whose first linear feeds GELU (fused with its
    output quantize), a residual add and layer norm, and a head kept in float."""

    def __init__(self, d=64):
        super().__init__()
        self.proj, self.up, self.down = nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, x):
        h = self.norm(torch.relu(self.proj(x)) + x)
        h = self.norm(self.down(nn.functional.gelu(self.up(h))) + h)
        return self.head(h)


def quantized(keep=()):
    torch.manual_seed(0)
    model = Block().eval()
    calib = [torch.randn(2, 16, 64) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = tk.quantize(model, "int8-static", calib_data=calib, progress=False, keep=list(keep))
    return model, q


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_rewrites_every_int8_linear_and_keeps_the_pt2e_numbers():
    model, q = quantized()
    gm = copy.deepcopy(q.graph)
    assert rewrite(gm.graph) == 4
    gm.recompile()
    ops = targets(gm)
    assert ops.count(torch.ops.torchkiln.qlinear_u8.default) == 4 and torch.ops.aten.linear.default not in ops
    assert torch.ops.aten.gelu.default not in ops  # GELU and its quantize are in up's epilogue
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        ref, fake, got = model(x), q(x), gm(x)
    e = rel(fake, ref)  # the quantization's own error
    assert 0 < e < 0.1
    # the same codes through int32 accumulation: a requantized value may land a step away here and there
    assert rel(got, fake) < 0.2 * e
    assert q.graph is not gm and torch.ops.aten.linear.default in targets(q.graph)  # the model untouched


def test_leaves_float_linears_alone():
    _, q = quantized(keep=("head", "up"))
    gm = copy.deepcopy(q.graph)
    assert rewrite(gm.graph) == 2  # proj and down; up and head stay float32 linears
    assert targets(gm).count(torch.ops.aten.linear.default) == 2
    assert torch.ops.aten.gelu.default in targets(gm)


def test_optimize_plans_it_and_serves_the_rewritten_graph():
    model, q = quantized()
    x = torch.randn(2, 16, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = tk.optimize(q, sample_input=x)
    report = served.kiln_report
    assert "int8_linear" in [p["pass"] for p in report.recipe["passes"]]
    with torch.no_grad(), torch.profiler.profile() as prof:
        got = served(x)
    if report.active.startswith("torchkiln compiled"):
        assert "torchkiln::qlinear_u8" in {e.key for e in prof.key_averages()}
    with torch.no_grad():
        fake, ref = q(x), model(x)
    assert rel(got, fake) < 0.2 * rel(fake, ref)
