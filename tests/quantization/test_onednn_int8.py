"""int8 CNNs through torch's eager oneDNN quantized modules (quantization/onednn_int8.py): the
lowering keeps every int8 conv pattern and the pt2e graph's numbers, the quantized engine is put
back, graphs it cannot lower say why, and optimize() times it as a candidate."""

import threading
import warnings

import needs
import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.quantization import onednn_int8
from torchkiln.quantization.onednn_int8 import OneDNNInt8, Unsupported

pytestmark = [needs.pt2e, pytest.mark.skipif(not onednn_int8.available(), reason="no oneDNN quantized engine")]


class Net(nn.Module):
    """Every pattern: conv + relu, conv + add + relu (an identity branch; a downsampling branch
    whose conv comes before the main path in graph order), a plain conv into an add, max and
    average pooling on int8, and a linear head whose output stays float."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.a1, self.a2 = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 1)
        self.b1, self.b2 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.Conv2d(32, 32, 1)
        self.down = nn.Conv2d(16, 32, 1, stride=2)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.a2(torch.relu(self.a1(x))) + x)
        identity = self.down(x)  # before the main path, as torchvision's ResNet is traced
        x = nn.functional.relu(self.b2(torch.relu(self.b1(x))) + identity, inplace=True)  # as ResNets do: the quantizer then quantizes the add (with torch.relu it leaves it float)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def quantized(model=None, shape=(2, 3, 32, 32)):
    torch.manual_seed(0)
    model = (model or Net()).eval()
    calib = [torch.randn(*shape) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, tk.quantize(model, "int8-static", calib_data=calib, progress=False), calib


@needs.int8_dot_cpu
def test_lowers_every_conv_pattern_and_keeps_the_pt2e_numbers():
    model, q, calib = quantized()
    served = OneDNNInt8(q)
    kinds = sorted(type(m).__name__ for n, m in served.lowered.named_children() if n.startswith("qconv_"))
    # b2's output is quantized and the downsampling conv adds it (ConvAddReLU2d), as in ResNets
    assert kinds == ["Conv2d", "ConvAddReLU2d", "ConvAddReLU2d"] + ["ConvReLU2d"] * 3
    code = served.lowered.code
    assert "max_pool2d" in code and "adaptive_avg_pool2d" in code and "dequantize" in code
    heads = [m for m in served.lowered.modules() if isinstance(m, onednn_int8.DynamicLinear)]
    assert len(heads) == 1 and "aten.linear" not in code  # the float-output head: int8 weights too
    assert_keeps_the_pt2e_numbers(model, q, served)


def assert_keeps_the_pt2e_numbers(model, q, served):
    """The pt2e graph computes in float on dequantized values (fake quantization); the int8 kernels
    accumulate in int32 and requantize, so they may differ by a rounding step here and there. Each is
    one quantization error e away from fp32; allowed: 2e from the pt2e graph (and from fp32)."""
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref, fake, got = model(x), q(x), served(x)
    e = float((fake - ref).norm() / ref.norm())
    assert 0 < e < 0.1
    assert float((got - fake).norm() / fake.norm()) < 2 * e
    assert float((got - ref).norm() / ref.norm()) < 2 * e
    assert torch.equal(got.argmax(-1), fake.argmax(-1))


class Reused(nn.Module):
    """A residual operand read again after its add (the program copies it instead of adding in
    place), a 4-D output (no flatten: an NCHW dequantize), and a ceil-mode max pool."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.a, self.b = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 1)

    def forward(self, x):
        x = self.stem(x)
        y = nn.functional.relu(self.a(x) + x, inplace=True)
        z = nn.functional.relu(self.b(y) + x, inplace=True)
        return nn.functional.max_pool2d(z, 3, 2, 1, ceil_mode=True)


@needs.int8_dot_cpu
def test_an_accumulator_read_again_is_copied_not_overwritten():
    # torch's ConvAddReLU2d writes its sum into the add's operand; x is read again by the second add,
    # so lower() gives the first one a copy (without it: 24% of the output's norm off the pt2e graph)
    model, q, _ = quantized(Reused(), shape=(2, 3, 15, 15))
    served = OneDNNInt8(q)
    assert served.lowered.code.count(".clone()") == 1  # the last read (b's add) needs none
    x = torch.randn(2, 3, 15, 15)
    with torch.no_grad():
        ref, fake, got = model(x), q(x), served(x)
    e = float((fake - ref).norm() / ref.norm())
    assert 0 < e < 0.1
    assert float((got - fake).norm() / fake.norm()) < 0.01  # a rounding step here and there, at most


def test_one_trace_per_shape_and_the_quantized_model_past_the_cap():
    _, q, _ = quantized()
    served = OneDNNInt8(q, max_signatures=1)
    a, b = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ya, yb = served(a), served(b)
        assert torch.allclose(yb, q(b))  # past the cap: the pt2e graph itself
        assert float((ya - q(a)).norm() / q(a).norm()) < 0.1
    assert len(served.traces) == 1


def _other_engine() -> str:
    return next(e for e in ("x86", "fbgemm", "qnnpack") if e in torch.backends.quantized.supported_engines)


def test_engine_is_onednn_inside_and_put_back_after_calls_and_errors():
    _, q, _ = quantized()
    before = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = _other_engine()
        served = OneDNNInt8(q)
        assert torch.backends.quantized.engine == _other_engine()  # packing did not leave it changed
        with torch.no_grad():
            served(torch.randn(2, 3, 32, 32))
        assert torch.backends.quantized.engine == _other_engine()
        with pytest.raises((AssertionError, RuntimeError)), torch.no_grad():
            served(torch.randn(2, 5, 32, 32))  # wrong channel count: export's guard fails inside the scope
        assert torch.backends.quantized.engine == _other_engine()
    finally:
        torch.backends.quantized.engine = before


def test_engine_scope_is_shared_by_threads_and_restored_by_the_last():
    before = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = _other_engine()
        inside, go, seen = threading.Event(), threading.Event(), []

        def first():
            with onednn_int8.onednn_engine():
                inside.set()
                go.wait(10)
                seen.append(torch.backends.quantized.engine)  # the other thread left meanwhile

        t = threading.Thread(target=first)
        t.start()
        inside.wait(10)
        with onednn_int8.onednn_engine():
            assert torch.backends.quantized.engine == "onednn"
        go.set()
        t.join(10)
        assert seen == ["onednn"]
        assert torch.backends.quantized.engine == _other_engine()
    finally:
        torch.backends.quantized.engine = before


def test_a_graph_without_convolutions_is_refused_with_the_reason():
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    _, q, _ = quantized(mlp, shape=(4, 16))
    with pytest.raises(Unsupported, match="no int8 convolution"):
        OneDNNInt8(q)
    with pytest.raises(Unsupported, match="not a pt2e-quantized model"):
        OneDNNInt8(mlp)


def test_optimize_times_it_and_serves_only_a_verified_candidate():
    model, q, calib = quantized()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(model, quantize="int8-static", calib_data=calib, sample_input=calib[0], time_budget=0.5)
    rep = tk.report(fast)
    row = next(m for m in rep.candidates if m.name.startswith("torchkiln oneDNN int8 modules"))
    assert row.status in ("passed", "served"), (row.status, row.reason)
    assert rep.recipe["onednn_graph"] and "oneDNN quantized modules" in str(rep)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref, got = model(x), fast(x)
    assert float((got - ref).norm() / ref.norm()) < 0.1


def test_onednn_graph_false_turns_it_off_and_a_saved_model_gets_it_back(tmp_path):
    """The serving knobs reach a quantized model's recipe (they were ignored before: compile_options too)."""
    model, q, calib = quantized()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        off = tk.optimize(model, quantize="int8-static", calib_data=calib, sample_input=calib[0], time_budget=0.3,
                          onednn_graph=False, compile_options={"cpp_wrapper": False})
        tk.quantization.save(q, tmp_path / "q.pt", float_model=model)
        loaded = tk.quantization.load(model, tmp_path / "q.pt")
        on = tk.optimize(loaded, sample_input=calib[0], time_budget=0.3)
    with pytest.warns(UserWarning, match="conv_bn_folding ignored for a quantized model"):
        tk.optimize(loaded, sample_input=calib[0], time_budget=0.1, conv_bn_folding=True, onednn_graph=False)
    assert not off.kiln_report.recipe["onednn_graph"]
    assert not any("oneDNN int8 modules" in m.name for m in off.kiln_report.candidates)
    assert off.kiln_report.recipe["compile_options"]["cpp_wrapper"] is False  # the plan sets True for pt2e CPU graphs
    row = next(m for m in on.kiln_report.candidates if m.name.startswith("torchkiln oneDNN int8 modules"))
    assert row.status in ("passed", "served"), (row.status, row.reason)


class Mobile(nn.Module):
    """MobileNet-style: ReLU6 after a pointwise and a depthwise conv (pt2e: conv -> hardtanh -> quantize), and
    a hardtanh(-1, 1) that the quantized output's saturation cannot stand in for."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(3, 24, 1), nn.BatchNorm2d(24), nn.ReLU6(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(24, 24, 3, padding=1, groups=24), nn.BatchNorm2d(24),
                                       nn.ReLU6(inplace=True))
        self.odd = nn.Sequential(nn.Conv2d(24, 16, 1), nn.Hardtanh(-1.0, 1.0))
        self.last = nn.Sequential(nn.Conv2d(16, 16, 1), nn.ReLU(inplace=True))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.last(self.odd(self.depthwise(self.expand(x))))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def test_relu6_convs_lower_where_the_output_range_does_the_clamp():
    torch.manual_seed(0)
    model = Mobile().train()
    with torch.no_grad():  # batch-norm statistics from data, so activations neither vanish nor explode
        for _ in range(5):
            model(torch.randn(8, 3, 32, 32))
    model, q, _ = quantized(model.eval())
    served = OneDNNInt8(q)
    kinds = {n: type(m).__name__ for n, m in served.lowered.named_children() if n.startswith("qconv_")}
    # expand and depthwise (ReLU6) as ConvReLU2d; `last` too; `odd` (hardtanh(-1, 1)) stays a float conv
    assert sorted(kinds.values()) == ["ConvReLU2d"] * 3, kinds
    assert "aten.hardtanh" in served.lowered.code and "aten.conv2d" in served.lowered.code
    assert_keeps_the_pt2e_numbers(model, q, served)
