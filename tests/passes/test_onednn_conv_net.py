"""A float32 / bfloat16 conv net's trunk as one oneDNN program (passes/onednn_conv_net.py, kernels/onednn_net.cpp),
with Winograd 3x3 convolutions: checked against the eager model (the reference, computed by torch's
own convolutions), each Winograd form forced on partial tiles, residuals read again later, its
refusals, and optimize() timing it as a candidate.

Tolerances: oneDNN's direct kernels and both Winograd forms land within 1e-6 of the output's norm
on these nets (measured 2e-7 to 6e-7); a wrong transform coefficient, tile offset, bias or residual
is off by far more (a tile's last row dropped: over 1e-2)."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchkiln as tk
from torchkiln.passes import onednn_conv_net
from torchkiln.passes.onednn_conv_net import OneDNNConvNet, Unsupported

pytestmark = pytest.mark.skipif(onednn_conv_net.why_not() is not None,
                                reason=f"no oneDNN conv net: {onednn_conv_net.why_not()}")
TOL = 1e-5


def trained(model: nn.Module) -> nn.Module:
    """Every BatchNorm with the statistics and affine terms a trained model has: folding must use them all."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model


def bn(c: int) -> nn.BatchNorm2d:
    return trained(nn.BatchNorm2d(c))


class Block(nn.Module):
    """A bottleneck: its 3x3 convolution is Winograd-eligible at stride 1; with a downsample the later
    convolution (the downsample, traced after conv3) takes the residual sum."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), bn(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), bn(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1), bn(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), bn(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.down is None else self.down(x)
        out += identity
        return torch.relu(out)


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), bn(16), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1, ceil_mode=True)
        self.blocks = nn.Sequential(Block(16, 16, 32), Block(32, 16, 32), Block(32, 32, 64, 2), nn.Dropout(0.1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.blocks(self.pool(self.stem(x))))


def small(seed: int = 0) -> SmallResNet:
    torch.manual_seed(seed)
    return SmallResNet().eval()


def rel(got, ref) -> float:
    return float((got - ref).norm() / ref.norm())


def assert_matches_eager(model: nn.Module, x: torch.Tensor, **kw) -> OneDNNConvNet:
    """The served program against the eager model: within TOL in float32, 0.02 in bf16 (whose own
    rounding is some 5e-3 on these nets)."""
    served = OneDNNConvNet(model, **kw)
    with torch.no_grad():
        ref, got = model(x), served(x)
    tol = 0.02 if kw.get("dtype") == torch.bfloat16 else TOL
    assert got.shape == ref.shape and got.dtype == torch.float32 and rel(got, ref) < tol
    return served


@pytest.mark.parametrize("winograd, forms", [(False, []), (4, [4, 4]), (2, [2, 2]), (True, None)])
def test_each_form_matches_eager_on_partial_tiles(winograd, forms):
    model = small()
    # 30x30 pools (ceil mode) to 15x15: the last 4x4 and 2x2 output tiles hang over the edge
    x = torch.randn(2, 3, 30, 30)
    served = OneDNNConvNet(model, winograd=winograd)
    with torch.no_grad():
        ref, got = model(x), served(x)
    assert got.shape == ref.shape and rel(got, ref) < TOL
    chosen = served.winograd()
    if forms is not None:
        assert chosen == forms  # the two stride-1 3x3 convolutions; the stride-2 one is never eligible
    else:
        assert len(chosen) == 2 and set(chosen) <= {0, 2, 4}
    code = served.rewritten.code
    # the whole model is one program: pool, flatten and Linear joined it as the classifier head
    assert "conv_net" in code and "conv2" not in code and "head" not in code


@pytest.mark.parametrize("winograd", [4, 2])
def test_many_tiles_go_through_in_chunks_with_a_tail(winograd):
    # 32 channels: a 4 MiB chunk holds 910 F(4x4) tiles (2 x 23 x 23 = 1058 here) or 2048 F(2x2) ones
    # (2 x 46 x 46 = 4232): both forms run full chunks and a shorter last one
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1)).eval()
    served = assert_matches_eager(model, torch.randn(2, 3, 92, 92), winograd=winograd)
    assert served.winograd() == [winograd, winograd]


class Grouped(nn.Module):
    """Depthwise, grouped, dilated and strided convolutions (direct kernels), a bias-free conv before
    a BatchNorm, ReLU as a method, and a max pool with padding."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 24, 3, stride=2, padding=1)
        self.dw, self.bn = nn.Conv2d(24, 24, 3, padding=2, dilation=2, groups=24, bias=False), bn(24)
        self.g = nn.Conv2d(24, 32, 3, padding=1, groups=4)
        self.pool = nn.MaxPool2d(2, 2, 1)

    def forward(self, x):
        y = self.bn(self.dw(self.a(x))).relu()
        return self.pool(self.g(y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_dilated_and_strided_convolutions_match_eager(dtype):
    torch.manual_seed(3)
    assert_matches_eager(Grouped().eval(), torch.randn(2, 3, 19, 23), dtype=dtype)


class Reread(nn.Module):
    """A residual operand read again after the add that takes it (the program copies it first), and
    an add whose operand is the convolution's own input."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.conv1 = nn.Conv2d(32, 32, 1)

    def forward(self, x):
        a = self.stem(x)
        b = torch.relu(self.conv3(a) + a)
        return self.conv1(a) + b


@pytest.mark.parametrize("winograd", [False, 4, 2])
def test_a_residual_read_again_is_not_overwritten(winograd):
    torch.manual_seed(1)
    assert_matches_eager(Reread().eval(), torch.randn(1, 3, 13, 11), winograd=winograd)


@pytest.mark.parametrize("winograd", [False, 4, 2])
def test_bfloat16_is_as_close_to_float32_as_a_plain_cast(winograd):
    model = small()
    x = torch.randn(2, 3, 30, 30)
    with torch.no_grad():
        ref = model(x)
        cast = copy.deepcopy(model).bfloat16()(x.bfloat16()).float()
        got = OneDNNConvNet(model, winograd=winograd, dtype=torch.bfloat16)(x)
    assert got.dtype == torch.float32
    # the guard's rule for bf16 (twice the plain cast's error, plus a floor); and bf16 really ran
    assert 1e-4 < rel(got, ref) < 2 * rel(cast, ref) + 1e-3


def test_a_bfloat16_model_takes_and_returns_bfloat16():
    model = small().bfloat16()
    x = torch.randn(1, 3, 24, 24, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        got = OneDNNConvNet(model, dtype=torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16 and rel(got.float(), ref.float()) < 0.02


class Heads(nn.Module):
    """Heads the program takes (pool to 1 x 1, flatten, Linear) up to what it does not (a second
    Linear after a ReLU), and a pool to 2 x 2, whose flatten and Linear stay in the graph."""

    def __init__(self, size: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(size)
        self.fc1, self.fc2 = nn.Linear(16 * size * size, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.pool(self.conv(x)).flatten(1))))


@pytest.mark.parametrize("size, joined", [(1, True), (2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_classifier_head_joins_the_program_only_after_a_global_pool(size, joined, dtype):
    torch.manual_seed(2)
    served = assert_matches_eager(Heads(size).eval(), torch.randn(3, 3, 12, 12), dtype=dtype)
    code = served.rewritten.code
    assert ("fc1" not in code) == joined and "fc2" in code


@pytest.mark.parametrize("model, dtype", [(small(), torch.float32), (small(), torch.bfloat16),
                                          (Heads(2).eval(), torch.bfloat16)])
def test_each_input_shape_gets_its_own_program_and_the_model_is_untouched(model, dtype):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [n for n, _ in model.named_modules()]
    served = OneDNNConvNet(model, winograd=4, dtype=dtype)
    with torch.no_grad():
        for shape in [(1, 3, 16, 16), (3, 3, 20, 26)]:  # Heads(2) pools 20 x 26 to 2 x 2 (divisors only)
            x = torch.randn(shape)
            got = served(x)
            assert got.dtype == torch.float32 and rel(got, model(x)) < (TOL if dtype == torch.float32 else 0.02)
    assert len(served.rewritten.conv_net.nets) == 2
    # BatchNorm folded into copies; a bf16 head runs on copies (Heads(2)'s fc1, fc2)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert [n for n, _ in model.named_modules()] == modules


class TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(3, 16, 1)

    def forward(self, x):
        return self.a(x), self.b(x)


class PadLeaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)

    def forward(self, x):
        p = F.pad(x, (1, 1, 1, 1))
        return self.conv(p), p


class PadThenPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.pool = nn.Conv2d(3, 16, 3), nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(nn.functional.pad(self.conv(x), (0, 1, 0, 1)))


class SiluTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x):
        return torch.sigmoid(F.silu(self.conv(x)))


class ReadTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return torch.relu(y) + y


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x):
        return self.conv(x) if x.sum() > 0 else -x


@pytest.mark.parametrize("model, match", [
    (nn.Sequential(nn.Conv2d(3, 16, 3), nn.GELU(), *[nn.Conv2d(16, 16, 3) for _ in range(3)]),
     "holds 1 of the model's 4 convolutions"),
    (PadLeaves(), "a zero-padded value leaves the conv region"),
    (PadThenPool(), "pool: reads a zero-padded value"),
    (ReadTwice(), "relu: a ReLU not right after a convolution"),
    (nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, padding_mode="reflect")), "padding_mode='reflect'"),
    (SiluTwice(), "a SiLU or sigmoid not right after a convolution"),
    (nn.Sequential(nn.Linear(4, 4)), "no convolution reads the model's first input"),
])
def test_what_it_cannot_hold_is_refused_with_the_reason(model, match):
    with pytest.raises(Unsupported, match=match):
        OneDNNConvNet(model.eval())


def test_a_branch_on_values_is_refused_at_the_first_call_with_both_front_ends_reasons():
    served = OneDNNConvNet(Branchy().eval())  # fx fails here; torch.export is tried at the first call
    with pytest.raises(Unsupported, match=r"torch.fx cannot trace Branchy: .*; torch.export cannot trace Branchy"):
        served(torch.randn(1, 3, 8, 8))


class InPlaceOnEarlier(nn.Module):
    """``y += z`` where ``y`` (the earlier operand) is read again afterwards: the program would put the
    sum in ``z``'s convolution and hand ``c`` the unchanged ``y``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(3, 16, 1), nn.Conv2d(16, 16, 1)

    def forward(self, x):
        y = self.a(x)
        z = self.b(x)
        y.add_(z)
        return self.c(y)


def test_an_in_place_add_to_a_value_read_again_is_refused():
    with pytest.raises(Unsupported, match="an in-place add to a value read again elsewhere"):
        OneDNNConvNet(InPlaceOnEarlier().eval())


def test_a_model_in_training_mode_and_another_dtype_are_refused():
    with pytest.raises(Unsupported, match="training mode"):
        OneDNNConvNet(small().train())
    with pytest.raises(Unsupported, match=r"dtype=torch.float16 \(torch.float32 or torch.bfloat16\)"):
        OneDNNConvNet(small(), dtype=torch.float16)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.02)])
def test_optimize_times_it_and_serves_only_a_verified_candidate(dtype, tol):
    model = small()
    x = torch.randn(2, 3, 30, 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = tk.optimize(model, dtype=dtype, sample_input=x, time_budget=0.5)
    report = tk.report(fast)
    name = f"torchkiln oneDNN conv net ({str(dtype).removeprefix('torch.')})"
    row = next(m for m in report.candidates if m.name == name)
    assert row.status in ("passed", "served"), (row.status, row.reason)
    if report.active == name:
        assert any(a.startswith("onednn_conv_net (") for a in report.applied)
    with torch.no_grad():
        ref, got = model(x), fast(x)
    assert got.dtype == torch.float32 and rel(got, ref) < tol


class ShapeChecked(nn.Module):
    """A Python branch on the input's shape before the trunk, as every transformers vision model has:
    torch.fx cannot trace it, torch.export turns it into a guard; the output is a dict."""

    def __init__(self):
        super().__init__()
        self.net = small()

    def forward(self, pixel_values):
        if pixel_values.shape[1] != 3:
            raise ValueError("3 channels only")
        return {"logits": self.net(pixel_values)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_fx_cannot_trace_is_exported_per_input_shape(dtype):
    model = ShapeChecked().eval()
    notes: list[str] = []
    served = OneDNNConvNet(model, dtype=dtype, notes=notes)
    assert served.rewritten is None  # nothing is built before the first call
    tol = TOL if dtype == torch.float32 else 0.02
    with torch.no_grad():
        for shape in [(2, 3, 30, 30), (1, 3, 16, 16)]:
            x = torch.randn(shape)
            got, ref = served(x), model(x)
            assert set(got) == {"logits"} and got["logits"].dtype == torch.float32
            assert rel(got["logits"], ref["logits"]) < tol
    assert len(served.graphs) == 2 and notes[0].startswith(f"onednn_conv_net ({str(dtype)[6:]}, from torch.export: 12 ")
    # the whole trunk and head are one program (torch.export's input guard, from torch 2.9 or so, stays)
    code = served.rewritten.code
    assert "conv_net" in code and "aten" not in code


def test_the_decomposed_aten_graph_is_taken_whole():
    """torch.export's core ATen forms: convolution, the legit batch norm's and the indexed max pool's
    getitem 0, a mean over H and W for the global pool, view for the flatten, addmm for the Linear."""
    model = small()
    x = torch.randn(2, 3, 30, 30)
    gm = torch.export.export(model, (x,)).run_decompositions().module()
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"aten.convolution.default", "aten._native_batch_norm_legit_no_training.default",
            "aten.max_pool2d_with_indices.default", "aten.mean.dim", "aten.addmm.default"} <= targets
    gm, walk = onednn_conv_net.rewrite(gm, winograd=4)
    assert walk.folded == 12 and "aten" not in gm.code
    with torch.no_grad():
        assert rel(gm(x), model(x)) < TOL


def test_a_transformers_resnet_is_served_whole():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(5)
    config = tf.ResNetConfig(embedding_size=16, hidden_sizes=[32, 64], depths=[1, 2], num_labels=7)
    model = trained(tf.ResNetForImageClassification(config).eval())
    x = torch.randn(2, 3, 64, 64)
    served = OneDNNConvNet(model)
    with torch.no_grad():
        got, ref = served(x), model(x)
    assert type(got) is type(ref) and rel(got.logits, ref.logits) < TOL
    assert served.front == "torch.export" and served.folded == served.convs
    assert "conv_net" in served.rewritten.code and "aten" not in served.rewritten.code


class Clipped(nn.Module):
    """Clamps as post-ops: ReLU6 after a 3x3 (Winograd-eligible) convolution, Hardtanh(-1, 2) after a
    residual add (the sum comes first), F.relu6 after a 1x1, and an explicit zero pad (TF "same",
    asymmetric before a stride-2 convolution, symmetric before a 3x3 one)."""

    def __init__(self):
        super().__init__()
        self.a, self.act = nn.Conv2d(3, 32, 3, padding=1), nn.ReLU6()
        self.b, self.bn, self.ht = nn.Conv2d(32, 32, 3, padding=1), bn(32), nn.Hardtanh(-1.0, 2.0)
        self.c = nn.Conv2d(32, 16, 1)
        self.down = nn.Conv2d(16, 32, 3, stride=2)
        self.d = nn.Conv2d(32, 32, 3)

    def forward(self, x):
        y = self.act(self.a(x))
        y = self.ht(self.bn(self.b(y)) + y)
        y = F.relu6(self.c(y))
        y = self.down(F.pad(y, (0, 1, 0, 1)))
        return self.d(F.pad(y, (1, 1, 1, 1)))


@pytest.mark.parametrize("winograd, forms", [(False, []), (4, [4, 4]), (2, [2, 2])])
def test_clamps_and_explicit_zero_pads_fold_into_the_convolutions(winograd, forms):
    torch.manual_seed(6)
    model = Clipped().eval()
    with torch.no_grad():  # enough signal past 6, 2 and -1 that every clamp bites
        model.a.weight.mul_(8)
    x = torch.randn(2, 3, 17, 17)
    with torch.no_grad():
        inner = model.act(model.a(x))
    assert float((inner == 6).float().mean()) > 0.05
    served = assert_matches_eager(model, x, winograd=winograd)
    assert served.winograd() == forms  # b and the padded d (a reads 3 channels: direct only)
    code = served.rewritten.code
    assert "pad" not in code and "relu6" not in code and "act" not in code


class ManyOut(nn.Module):
    """Several values leave the trunk (as a transformers base model's last_hidden_state and
    pooler_output), one of them read by an op outside before the trunk's last convolution."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        scale = y.mean()  # outside the region, made before b runs in the graph
        z = self.b(y)
        return z * scale, self.pool(z).flatten(1), y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_outputs_leave_one_program(dtype):
    torch.manual_seed(7)
    model = ManyOut().eval()
    x = torch.randn(2, 3, 12, 12)
    served = OneDNNConvNet(model, dtype=dtype)
    with torch.no_grad():
        got, ref = served(x), model(x)
    tol = TOL if dtype == torch.float32 else 0.02
    assert len(got) == 3 and all(g.dtype == torch.float32 and rel(g, r) < tol for g, r in zip(got, ref, strict=True))
    code = served.rewritten.code
    assert code.count("conv_net[") == 3 and "self.a(" not in code and "self.b(" not in code


def test_a_transformers_mobilenet_base_model_is_served_whole():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(8)
    config = tf.MobileNetV2Config(depth_multiplier=0.35, image_size=64)  # TF padding, ReLU6, depthwise
    model = trained(tf.MobileNetV2Model(config).eval())
    x = torch.randn(2, 3, 64, 64)
    served = OneDNNConvNet(model)
    with torch.no_grad():
        got, ref = served(x), model(x)
    assert type(got) is type(ref)
    for name in ("last_hidden_state", "pooler_output"):
        assert rel(getattr(got, name), getattr(ref, name)) < TOL, name
    assert served.folded == served.convs and "conv_net" in served.rewritten.code
    code = served.rewritten.code  # the pads, clamps and the pool all joined it; the pooler's flatten did not
    assert not [op for op in ("conv2d", "aten.pad", "hardtanh", "batch_norm", "adaptive_avg_pool2d") if op in code]


class SqueezeExcite(nn.Module):
    """EfficientNet's block: a SiLU expansion, a depthwise convolution with "same" padding, a
    squeeze-and-excite gate (global pool, 1x1 convolutions with SiLU and sigmoid, a broadcast product),
    a projection with a residual add, an even kernel's asymmetric "same" padding, and a pooler that
    is one window over the whole input."""

    def __init__(self):
        super().__init__()
        self.expand, self.bn1 = nn.Conv2d(16, 64, 1, bias=False), bn(64)
        self.dw, self.bn2 = nn.Conv2d(64, 64, 5, padding="same", groups=64, bias=False), bn(64)
        self.reduce, self.grow = nn.Conv2d(64, 8, 1), nn.Conv2d(8, 64, 1)
        self.project, self.bn3 = nn.Conv2d(64, 16, 1, bias=False), bn(16)
        self.even = nn.Conv2d(16, 32, 4, padding="same")
        self.pool = nn.AvgPool2d(64, ceil_mode=True)

    def forward(self, x):
        y = F.silu(self.bn1(self.expand(x)))
        y = nn.functional.silu(self.bn2(self.dw(y)))
        gate = torch.sigmoid(self.grow(F.silu(self.reduce(F.adaptive_avg_pool2d(y, 1)))))
        y = self.bn3(self.project(y * gate)) + x
        return self.pool(torch.relu(self.even(y)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_squeeze_excite_block_with_silu_and_same_padding_matches_eager(dtype):
    torch.manual_seed(9)
    served = assert_matches_eager(SqueezeExcite().eval(), torch.randn(2, 16, 13, 11), dtype=dtype)
    code = served.rewritten.code
    assert "conv_net" in code and not [m for m in ("silu", "sigmoid", "pool", "even", "mul") if m in code]


class BadProduct(nn.Module):
    """Two full maps multiplied (a gating the program's broadcast product does not cover)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(3, 16, 1)

    def forward(self, x):
        return self.a(x) * self.b(x)


def test_a_product_of_two_full_maps_is_refused_at_the_first_call():
    served = OneDNNConvNet(BadProduct().eval())  # the shapes are known only when the program is built
    with pytest.raises(Unsupported, match=r"a product of values shaped .* \(one \(N, C, 1, 1\) only\)"):
        served(torch.randn(1, 3, 8, 8))


def test_a_transformers_efficientnet_is_served_whole():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(10)
    config = tf.EfficientNetConfig(width_coefficient=0.25, depth_coefficient=0.25, image_size=64, hidden_dim=320,
                                   num_labels=5)
    model = trained(tf.EfficientNetForImageClassification(config).eval())
    x = torch.randn(2, 3, 64, 64)
    served = OneDNNConvNet(model)
    with torch.no_grad():
        got, ref = served(x), model(x)
    assert rel(got.logits, ref.logits) < TOL and served.front == "torch.export"
    code = served.rewritten.code  # the trunk, its gates and pooler in the program; the classifier after it
    assert not [op for op in ("conv2d", "aten.pad", "silu", "sigmoid", "batch_norm", "avg_pool2d") if op in code]
