"""An int8 CNN's trunk as one oneDNN program (quantization/onednn_net.py, kernels/onednn_net.cpp):
checked against torch's own quantized modules on the same weights and scales (onednn_int8.py, the
reference computed by other code), its buffer reuse and in-place residual adds, its refusals, and
optimize() timing it as a candidate."""

import threading
import warnings

import needs
import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.kernels import onednn_net as kernel
from torchkiln.quantization import onednn_net
from torchkiln.quantization.onednn_int8 import OneDNNInt8
from torchkiln.quantization.onednn_net import OneDNNNet, Unsupported

from .test_onednn_int8 import Mobile, Reused, quantized

pytestmark = [needs.pt2e, needs.int8_dot_cpu,
              pytest.mark.skipif(not onednn_net.available(), reason=f"no oneDNN int8 net: {onednn_net.why_not()}")]


def assert_matches_torchs_modules(q, x, tol=0.01, modules=True):
    """The same quantization computed by other code: the pt2e graph itself (float arithmetic on the
    dequantized grid) and torch's quantized modules (onednn_int8.py). All round to the same uint8 grid
    after every layer, so they differ only where a value lands within rounding of a step boundary
    (measured 0-0.2% of the output's norm on these nets); a wrong scale, zero point, bias, post-op or
    buffer is off by far more (a residual read from a reused buffer: 7%)."""
    with torch.no_grad():
        fake, got = q(x), OneDNNNet(q)(x)
        ref = OneDNNInt8(q)(x) if modules else fake
    assert got.shape == fake.shape and got.dtype == torch.float32
    assert float((got - fake).norm() / fake.norm()) < tol
    assert float((got - ref).norm() / ref.norm()) < tol
    return ref, got


def test_every_pattern_matches_torchs_quantized_modules():
    model, q, _ = quantized()
    served = OneDNNNet(q)
    # one Runner call stands for the whole int8 region and the classifier head after it
    code = served.rewritten.code
    assert "int8_net" in code and "qconv" not in code and "max_pool2d" not in code and "qlinear" not in code
    x = torch.randn(2, 3, 32, 32)
    ref, got = assert_matches_torchs_modules(q, x)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    with torch.no_grad():  # and one quantization error from fp32, as the modules are
        fp32 = model(x)
    assert float((got - fp32).norm() / fp32.norm()) < 0.1


def test_the_classifier_head_runs_in_the_program_on_the_calibrated_grid():
    """The head (lower()'s DynamicLinear, which re-quantizes its input per call) as the program's int8
    matmul on the region's own codes: the pt2e graph's arithmetic, so at least as close to it as the
    head after the program, and the head's module gone; head=False keeps it a module call."""
    _, q, _ = quantized()
    x = torch.randn(4, 3, 32, 32)
    inside, after = OneDNNNet(q), OneDNNNet(q, head=False)
    assert "qlinear" in after.rewritten.code and "qlinear" not in inside.rewritten.code
    assert not [n for n, _ in inside.rewritten.named_children() if n.startswith("qlinear")]
    with torch.no_grad():
        fake, a, b = q(x), inside(x), after(x)
    err_inside, err_after = (float((y - fake).norm() / fake.norm()) for y in (a, b))
    assert a.shape == fake.shape == (4, 10) and a.dtype == torch.float32
    assert err_inside < 0.01 and err_inside <= err_after * 1.05, (err_inside, err_after)


def with_bn_statistics(model: nn.Module) -> nn.Module:
    """Batch-norm statistics from data, so activations neither vanish nor explode; in eval mode."""
    torch.manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(8, 3, 16, 16))
    return model.eval()


def test_a_float_op_between_int8_convs_is_refused_with_the_reason():
    _, q, _ = quantized(with_bn_statistics(Mobile()), shape=(2, 3, 16, 16))
    # hardtanh(-1, 1) stays float in the lowered graph, so the convs after it start a second int8 region
    with pytest.raises(Unsupported, match="2 input quantizes"):
        OneDNNNet(q)


class Mobile6(nn.Module):
    """Depthwise (groups = channels) and ReLU6 convs only, all of which lower."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(3, 24, 1), nn.BatchNorm2d(24), nn.ReLU6(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(24, 24, 3, padding=1, groups=24), nn.BatchNorm2d(24),
                                       nn.ReLU6(inplace=True))
        self.grouped = nn.Sequential(nn.Conv2d(24, 32, 3, stride=2, padding=1, groups=4), nn.ReLU(inplace=True))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.grouped(self.depthwise(self.expand(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def test_grouped_and_depthwise_convs_match():
    _, q, _ = quantized(with_bn_statistics(Mobile6()), shape=(2, 3, 16, 16))
    assert_matches_torchs_modules(q, torch.randn(2, 3, 16, 16))


def test_a_residual_read_twice_and_an_nchw_output_match():
    _, q, _ = quantized(Reused(), shape=(2, 3, 15, 15))
    ref, got = assert_matches_torchs_modules(q, torch.randn(2, 3, 15, 15))
    assert got.shape == (2, 16, 8, 8)


def test_one_program_per_shape_and_the_quantized_model_past_the_cap():
    _, q, _ = quantized()
    served = OneDNNNet(q, max_signatures=1)
    a, b = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ya, yb = served(a), served(b)
        assert torch.allclose(yb, q(b))  # past the cap: the pt2e graph itself
        assert float((ya - OneDNNInt8(q)(a)).norm() / ya.norm()) < 0.01
    assert len(served.rewritten.int8_net.nets) == 1


def test_calls_from_two_threads_get_their_own_results():
    _, q, _ = quantized()
    served = OneDNNNet(q)
    xs = [torch.randn(2, 3, 32, 32) for _ in range(2)]
    with torch.no_grad():
        want = [served(x) for x in xs]
    got, errors = [[None] * 20 for _ in xs], []

    def work(i):
        try:
            with torch.no_grad():
                for k in range(20):
                    got[i][k] = served(xs[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(torch.equal(g, want[i]) for i in range(2) for g in got[i])


def test_graphs_it_cannot_hold_are_refused_with_the_reason():
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    _, q, _ = quantized(mlp, shape=(4, 16))
    with pytest.raises(Unsupported):
        OneDNNNet(q)
    with pytest.raises(Unsupported, match="not a pt2e-quantized model"):
        OneDNNNet(mlp)


@pytest.mark.parametrize("size,k,s,p", [(15, 3, 2, 1), (16, 3, 2, 1), (7, 2, 2, 0), (9, 3, 3, 1), (112, 3, 2, 1)])
def test_pooled_size_is_torchs(size, k, s, p):
    for ceil in (False, True):
        want = nn.functional.max_pool2d(torch.zeros(1, 1, size, size), k, s, p, ceil_mode=ceil).shape[-1]
        assert kernel._pooled(size, k, s, p, ceil) == want


def test_a_missing_onednn_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHKILN_ONEDNN_ROOT", str(tmp_path))
    why = kernel.find()
    assert isinstance(why, str) and "TORCHKILN_ONEDNN_ROOT" in why and str(tmp_path) in why
    assert 'pip install "torchkiln[onednn]"' in why


def test_optimize_times_it_and_serves_only_a_verified_candidate():
    model, _, calib = quantized()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(model, quantize="int8-static", calib_data=calib, sample_input=calib[0], time_budget=0.5)
    row = next(m for m in tk.report(fast).candidates if m.name.startswith("torchkiln oneDNN int8 net"))
    assert row.status in ("passed", "served"), (row.status, row.reason)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref, got = model(x), fast(x)
    assert float((got - ref).norm() / ref.norm()) < 0.1
