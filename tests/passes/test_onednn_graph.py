"""oneDNN Graph serving (passes/onednn_graph.py): per-signature traces, refused unsafe
traces, the fuser switch restored, and its place among optimize()'s candidates."""

import warnings

import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.passes import onednn_graph
from torchkiln.passes.onednn_graph import OneDNNGraph, Unsupported

pytestmark = pytest.mark.skipif(not onednn_graph.available(), reason="torch build without the oneDNN Graph fuser")


def convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10)).eval()


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return torch.relu(self.b(torch.relu(self.a(x))) + x)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return y if bool(y.sum() > 0) else -y  # a trace would keep only the branch it saw


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return {"y": self.conv(x)}


@pytest.mark.parametrize("make", [convnet, Residual], ids=["convnet", "residual"])
def test_matches_eager_at_every_traced_shape(make):
    model = make().eval()
    cin = 8 if make is Residual else 3
    fn = OneDNNGraph(model)
    for shape in [(1, cin, 16, 16), (3, cin, 12, 20)]:
        x = torch.randn(shape)
        with torch.no_grad():
            ref = model(x)
        torch.testing.assert_close(fn(x), ref, rtol=1e-4, atol=1e-5)
    assert len(fn.traces) == 2


def test_beyond_max_signatures_runs_eager_and_stays_correct():
    model = convnet()
    fn = OneDNNGraph(model, max_signatures=1)
    fn(torch.randn(1, 3, 8, 8))
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-5)
    assert len(fn.traces) == 1


def test_a_new_shape_never_reuses_another_shapes_trace():
    assert onednn_graph.signature((torch.zeros(1, 3),), {}) != onednn_graph.signature((torch.zeros(2, 3),), {})
    assert onednn_graph.signature((torch.zeros(1, 3), True), {}) != onednn_graph.signature((torch.zeros(1, 3), False), {})


def test_data_dependent_branch_is_refused_with_its_location():
    with pytest.raises(Unsupported, match="data-dependent.*|Python value"):
        OneDNNGraph(DataDependent().eval())(torch.randn(1, 3, 8, 8))


def test_non_tensor_outputs_are_refused():
    with pytest.raises(Unsupported, match="outputs are not a tensor"):
        OneDNNGraph(DictOut().eval())(torch.randn(1, 3, 8, 8))


def test_fuser_switch_is_restored():
    before = torch._C._jit_llga_enabled()
    OneDNNGraph(convnet())(torch.randn(1, 3, 8, 8))
    assert torch._C._jit_llga_enabled() == before


def test_optimize_times_it_for_conv_nets_and_serves_only_a_passing_winner():
    model = convnet()
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(model, sample_input=x)
    rows = {c.name: c for c in fast.kiln_report.candidates}
    graph = rows["torchkiln oneDNN graph (float32)"]
    assert graph.median_ms is not None and graph.status in ("served", "passed"), graph
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)


def test_knob_off_means_no_candidate():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(convnet(), sample_input=torch.randn(1, 3, 16, 16), onednn_graph=False)
    assert not any("oneDNN graph" in c.name for c in fast.kiln_report.candidates)


class Flags(nn.Module):
    """Non-tensor inputs beside the tensor: a float scale, a string, and a flag that changes the output's form."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x, scale=1.0, pool="mean", as_dict=False):
        y = torch.relu(self.conv(x)) * scale
        z = y.mean((2, 3)) if pool == "mean" else y.amax((2, 3))
        return {"z": z} if as_dict else z


def test_non_tensor_inputs_are_bound_one_trace_per_value():
    """A float given positionally failed torch.jit.trace ("Tuple[Tensor, float] cannot be traced"),
    which stepped the whole candidate down; a later signature whose output a trace would change
    runs eagerly instead of raising. References: the model itself, call for call."""
    model = Flags().eval()
    fn = OneDNNGraph(model, max_signatures=8)
    x = torch.randn(2, 3, 10, 10)
    calls = [((x,), {}), ((x, 2.0), {}), ((x,), {"scale": 3.0, "pool": "max"}), ((x, 0.5, "max"), {}),
             ((x,), {"as_dict": True})]
    for args, kwargs in calls:
        with torch.no_grad():
            out, ref = fn(*args, **kwargs), model(*args, **kwargs)
        if isinstance(ref, dict):
            assert isinstance(out, dict) and out.keys() == ref.keys()
            out, ref = out["z"], ref["z"]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    eager = [k for k, t in fn.traces.items() if t is onednn_graph._EAGER]
    assert len(fn.traces) == 5 and eager == [onednn_graph.signature((x,), {"as_dict": True})]


def test_an_untraceable_first_signature_still_refuses():
    with pytest.raises(Unsupported, match="outputs are not a tensor"):
        OneDNNGraph(Flags().eval())(torch.randn(1, 3, 8, 8), as_dict=True)
