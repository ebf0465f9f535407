"""Layers a pt2e int8 graph keeps in float32, served through oneDNN (passes/onednn_linear.py
onednn_linear_graph; quantization/plan.py _float_gemm)."""

import copy
import functools
import math
import warnings

import needs
import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.passes.onednn_linear import OneDNNLinear, available, graph_float_linears, onednn_linear_graph
from torchkiln.quantization import plan as qplan

pytestmark = [needs.pt2e, pytest.mark.skipif(not available(torch.float32), reason="torch built without oneDNN")]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 16)).eval()


def data(n=4, bs=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(bs, 3, 64, generator=g) for _ in range(n)]


def quantized(keep=("0",)):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tk.quantize(mlp(), "int8-dynamic", calib_data=data(), keep=keep, progress=False)


def test_kept_layers_are_the_float_linears_and_shapes_are_split():
    q = quantized(keep=("0",))
    assert len(graph_float_linears(q.graph)) == 1
    assert qplan.linear_shapes(q) == {"float": [(64, 256)], "int8": [(256, 64), (64, 16)]}
    assert qplan.linear_shapes(nn.Linear(2, 2)) == {"float": [], "int8": []}


def test_routed_graph_matches_the_unrouted_graph():
    """The routed linear computes the kept layer: compared with the same graph through aten.linear
    (torch's own GEMM), on a 3-D input (the module flattens the leading dims)."""
    q = quantized(keep=("0",))
    x = data(1)[0]
    with torch.no_grad():
        ref = q(x)
        routed = copy.deepcopy(q)
        target = graph_float_linears(routed.graph)[0].args[1].target
        assert onednn_linear_graph(routed.graph) == 1
        assert sum(isinstance(m, OneDNNLinear) for m in routed.graph.modules()) == 1
        assert not graph_float_linears(routed.graph)
        out = routed(x)
    # fp32 GEMMs of two libraries: rounding differs, and the next layer's dynamic int8 quantization
    # may flip a code; a wrong weight, bias or layout is off by O(1)
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.02)
    # the weights are shared with the graph's attributes, not copied
    lin = next(m for m in routed.graph.modules() if isinstance(m, OneDNNLinear))
    assert lin.weight.data_ptr() == functools.reduce(getattr, target.split("."), routed.graph).data_ptr()


def _rates(aten, onednn):
    return lambda dtype, m, k, n: ("onednn" if onednn > 1.1 * aten else "aten", {"aten": aten, "onednn": onednn})


def test_plan_routes_kept_linears_only_where_the_gain_beats_the_cpp_wrapper(monkeypatch):
    q = quantized(keep=("0",))
    shapes = qplan.linear_shapes(q)  # share: 64*256 / (64*256 + 256*64 + 64*16) = 0.485
    monkeypatch.setattr(qplan, "gemm_choice", _rates(200.0, 480.0))  # gain 0.485 * (1 - 200/480) = 0.28
    r = qplan.plan(q.kiln_quant, "cpu", "O1", linears=shapes)
    assert r.pass_config("onednn_linear") is not None
    assert "cpp_wrapper" not in dict(r.compile_options) and dict(r.compile_options)["freezing"]
    assert any("expected gain 28%" in n for n in r.notes)
    monkeypatch.setattr(qplan, "gemm_choice", _rates(450.0, 480.0))  # 0.485 * 0.0625 = 0.03 < 0.05
    r = qplan.plan(q.kiln_quant, "cpu", "O1", linears=shapes)
    assert r.pass_config("onednn_linear") is None and dict(r.compile_options)["cpp_wrapper"]
    assert any("aten (oneDNN not 10% faster)" in n for n in r.notes)
    monkeypatch.setattr(qplan, "gemm_choice", _rates(300.0, 340.0))  # oneDNN faster, gain 0.485 * 0.12 = 0.057
    assert qplan.plan(q.kiln_quant, "cpu", "O1", linears=shapes).pass_config("onednn_linear") is not None
    monkeypatch.setattr(qplan, "gemm_choice", _rates(300.0, 334.0))  # 0.485 * 0.102 = 0.049: not above
    r = qplan.plan(q.kiln_quant, "cpu", "O1", linears=shapes)
    assert r.pass_config("onednn_linear") is None and any("with the C++ wrapper" in n for n in r.notes)
    monkeypatch.setattr(qplan, "gemm_choice", _rates(200.0, 480.0))
    assert qplan.plan(q.kiln_quant, "cpu", "O0", linears=shapes).pass_config("onednn_linear") is None
    # a conv graph keeps the C++ wrapper (its FLOPs are the convs'; a kept head is a small share)
    conv = qplan.plan(q.kiln_quant, "cpu", "O1", has_conv=True, linears=shapes)
    assert conv.pass_config("onednn_linear") is None and dict(conv.compile_options)["cpp_wrapper"]
    nothing_kept = quantized(keep=())
    assert qplan.plan(nothing_kept.kiln_quant, "cpu", "O1",
                      linears=qplan.linear_shapes(nothing_kept)).pass_config("onednn_linear") is None


def test_optimize_serves_the_routed_graph_and_leaves_the_callers_alone(monkeypatch):
    q = quantized(keep=("0",))
    before = [n.target for n in q.graph.graph.nodes]
    monkeypatch.setattr(qplan, "gemm_choice", _rates(200.0, 480.0))
    x = data(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(q, sample_input=x, time_budget=0.5, candidates="torchkiln")
    assert fast.kiln_recipe.pass_config("onednn_linear") is not None
    assert any(a.startswith("onednn_linear (1 float32 linears") for a in fast.kiln_report.applied)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), q(x), rtol=0.02, atol=0.02)
    assert [n.target for n in q.graph.graph.nodes] == before  # the caller's graph is not rewritten
    assert not any(isinstance(m, OneDNNLinear) for m in q.modules())
    assert math.isfinite(float(fast(x).sum()))
