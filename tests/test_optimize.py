import importlib
import warnings

import pytest
import torch
from threads import assert_threads_match_serial
from torch import nn

import torchkiln as tk
from torchkiln.recipe import Recipe

opt_mod = importlib.import_module("torchkiln.optimize")  # the package attribute is the function


def mlp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Dropout(0.2),
                      nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 10)).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    return m


def cnn():
    torch.manual_seed(0)
    # The second conv has no BatchNorm: passes must still leave its weight alone.
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    return m


def test_fp32_compiled_matches_eager_and_reports():
    m, x = mlp(), torch.randn(8, 32)
    ref = m(x)
    o = tk.optimize(m, sample_input=x)
    torch.testing.assert_close(o(x), ref, rtol=1e-4, atol=1e-5)
    rep = tk.report(o)
    assert rep is o.kiln_report and rep.active.startswith("compiled full graph")
    assert any(a.startswith("fold_linear_bn (1") for a in rep.applied)
    assert rep.error["rel"] < 1e-4 and rep.optimize_seconds > 0 and rep.fallbacks == []
    assert "compiled full graph" in str(rep)


def test_state_dict_keeps_keys_and_values_and_loads_both_ways():
    m, x = cnn(), torch.randn(2, 3, 8, 8)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    o = tk.optimize(m, sample_input=x, graph_mode=False)
    got = o.state_dict()
    assert list(got) == list(sd)
    for k in sd:
        torch.testing.assert_close(got[k], sd[k], rtol=0, atol=0)
    # New weights into the optimized model: it must compute with them (rebuilt, re-verified).
    other = cnn()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)
    o.load_state_dict(other.state_dict())
    torch.testing.assert_close(o(x), other(x), rtol=1e-4, atol=1e-5)
    fresh = cnn()
    fresh.load_state_dict(o.state_dict())  # and back into a plain model
    torch.testing.assert_close(fresh(x), other(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_original_model_is_never_mutated(dtype):
    if dtype is not None and not tk.detect().cpu.bf16_native:
        pytest.skip("no native bf16 on this CPU")
    m, x = cnn(), torch.randn(2, 3, 8, 8)
    before = {k: (v.data_ptr(), v.stride(), v.clone()) for k, v in m.state_dict(keep_vars=True).items()}
    kinds = [type(c) for c in m.modules()]
    o = tk.optimize(m, dtype=dtype, sample_input=x)
    o(x)
    assert [type(c) for c in m.modules()] == kinds  # no folded/replaced submodules
    for k, v in m.state_dict(keep_vars=True).items():
        ptr, stride, val = before[k]
        assert v.data_ptr() == ptr and v.stride() == stride and v.dtype == val.dtype, k
        torch.testing.assert_close(v, val, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["tensor", "tuple", "dict"])
def test_sample_input_forms(form):
    class Two(nn.Module):
        def forward(self, a, b=None):
            return a * 2 + (0 if b is None else b)

    a = torch.randn(3)
    sample = {"tensor": a, "tuple": (a, a), "dict": {"a": a, "b": a}}[form]
    o = tk.optimize(Two(), sample_input=sample, graph_mode=False)
    args, kwargs = ((a,), {}) if form == "tensor" else (((a, a), {}) if form == "tuple" else ((), {"a": a, "b": a}))
    torch.testing.assert_close(o(*args, **kwargs), Two()(*args, **kwargs))


def test_bf16_within_tolerance_and_outputs_fp32():
    if not tk.detect().cpu.bf16_native:
        pytest.skip("no native bf16 on this CPU")
    m, x = mlp(), torch.randn(8, 32)
    o = tk.optimize(m, dtype=torch.bfloat16, sample_input=x, graph_mode=False)
    y = o(x)
    assert y.dtype == torch.float32
    ref = m(x)
    assert ((y - ref).norm() / ref.norm()).item() < 5e-2
    assert o.kiln_recipe.dtype == "bfloat16" and o.kiln_report.error["rel"] > 0


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_bf16_on_cpu_without_native_support_keeps_fp32_and_warns(monkeypatch, level):
    from dataclasses import replace

    hw = tk.detect()
    no_bf16 = replace(hw, cpu=replace(hw.cpu, features=tuple(f for f in hw.cpu.features
                                                             if f not in ("avx512_bf16", "amx_bf16", "bf16"))))
    monkeypatch.setattr(opt_mod, "detect", lambda: no_bf16)
    opt_mod._warned.clear()
    with pytest.warns(UserWarning, match="no native bf16"):
        o = tk.optimize(mlp(), dtype="bf16", level=level, graph_mode=False)
    assert o.kiln_recipe.dtype == "float32"


def test_compile_failure_steps_down_and_is_recorded(monkeypatch):
    class Boom(nn.Module):
        def forward(self, *a, **k):
            raise RuntimeError("simulated inductor crash")

    monkeypatch.setattr(opt_mod, "compile_model", lambda *a, **k: Boom())
    opt_mod._warned.clear()
    m, x = mlp(), torch.randn(4, 32)
    with pytest.warns(UserWarning, match="simulated inductor crash"):
        o = tk.optimize(m, sample_input=x)
    rep = o.kiln_report
    assert rep.active == "eager passes (float32)"
    assert rep.fallbacks[0].reason.startswith("RuntimeError: simulated inductor crash")
    torch.testing.assert_close(o(x), m(x), rtol=1e-4, atol=1e-5)


def test_numeric_guard_falls_back_to_safer_recipe(monkeypatch):
    real = opt_mod.cast_dtype

    def broken_cast(model, dtype, fp32):  # a pass that silently corrupts weights
        model = real(model, dtype, fp32)
        for mod in model.modules():  # new tensors, as passes make: the original stays intact
            for k, p in list(mod._parameters.items()):
                mod._parameters[k] = nn.Parameter(p.detach() * 3)
        return model

    monkeypatch.setattr(opt_mod, "cast_dtype", broken_cast)
    m, x = mlp(), torch.randn(4, 32)
    with pytest.warns(UserWarning, match="output differs from fp32 eager"):
        o = tk.optimize(m, dtype=torch.bfloat16, sample_input=x, graph_mode=False)
    assert o.kiln_report.active == "eager passes (float32)"
    torch.testing.assert_close(o(x), m(x), rtol=1e-4, atol=1e-5)


def test_guard_runs_on_first_call_without_sample():
    m, x = mlp(), torch.randn(4, 32)
    o = tk.optimize(m, graph_mode=False)
    assert o.kiln_report.error is None
    o(x)
    assert o.kiln_report.error["rel"] < 1e-4


def test_ipex_knobs_switch_passes():
    r = tk.optimize(cnn(), conv_bn_folding=False, replace_dropout_with_identity=False, weights_prepack=False,
                    graph_mode=False).kiln_recipe
    assert "fold_conv_bn" not in r.passes and "replace_dropout" not in r.passes
    assert "onednn_linear" not in r.passes and r.gemm == "aten" and r.compile is False
    r = tk.optimize(mlp(), level="O0").kiln_recipe
    assert r.passes == () and r.compile is False


def test_bad_inputs_get_clear_errors():
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got str"):
        tk.optimize("model")
    with pytest.raises(TypeError, match="TorchScript"):
        tk.optimize(torch.jit.script(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported.*bfloat16"):
        tk.optimize(mlp(), dtype="int8")
    with pytest.raises(ValueError, match="level='O3'"):
        tk.optimize(mlp(), level="O3")
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['fast'\].*conv_bn_folding"):
        tk.optimize(mlp(), fast=True)
    with pytest.raises(ValueError, match="sample_input was rejected by the model itself"):
        tk.optimize(mlp(), sample_input=torch.randn(2, 7))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda:0' is not usable.*usable devices: \['cpu'\]"):
            tk.optimize(mlp(), device="cuda")


def test_already_optimized_and_intel_only_knobs_warn():
    opt_mod._warned.clear()
    o = tk.optimize(mlp(), graph_mode=False)
    with pytest.warns(UserWarning, match="already optimized"):
        assert tk.optimize(o) is o
    with pytest.warns(UserWarning, match="optimize_lstm is an Intel-IPEX-only knob"):
        tk.optimize(mlp(), optimize_lstm=True, graph_mode=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tk.optimize(mlp(), optimize_lstm=True, graph_mode=False)  # once only


def test_moving_an_optimized_model_is_refused_clearly():
    o = tk.optimize(mlp(), graph_mode=False)
    with pytest.raises(RuntimeError, match="optimize again"):
        o.to(torch.float64)


def test_eight_threads_match_serial_results():
    m = mlp()
    xs = [torch.randn(4, 32) for _ in range(8)]
    o = tk.optimize(m, sample_input=xs[0])
    assert_threads_match_serial(o, xs)


def test_many_models_of_one_class_all_stay_compiled():
    # dynamo's recompile limit is per code object; each runner gets its own.
    x = torch.randn(2, 32)
    for _ in range(10):
        m = mlp()
        with torch.no_grad():
            m[0].weight.normal_()
        o = tk.optimize(m, sample_input=x)
        assert o.kiln_report.active.startswith("compiled"), o.kiln_report
        torch.testing.assert_close(o(x), m(x), rtol=1e-4, atol=1e-4)


def test_recipe_is_json_round_trippable_and_printable():
    r = tk.optimize(mlp(), graph_mode=False).kiln_recipe
    assert Recipe.from_dict(__import__("json").loads(r.to_json())) == r
    assert "Recipe for cpu at O1" in str(r)
    with pytest.raises(ValueError, match="unknown passes"):
        r.replace(passes=("nope",))


def test_later_failure_steps_down_but_user_errors_raise(monkeypatch):
    class Flaky(nn.Module):
        fail = False

        def __init__(self, runner):
            super().__init__()
            self.runner = runner

        def forward(self, *a, **k):
            if Flaky.fail:
                raise RuntimeError("recompile crashed")
            return self.runner(*a, **k)

    monkeypatch.setattr(opt_mod, "compile_model", lambda runner, *a, **k: Flaky(runner))
    opt_mod._warned.clear()
    m, x = mlp(), torch.randn(4, 32)
    o = tk.optimize(m, sample_input=x)
    assert o.kiln_report.active == "compiled full graph (float32)"
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        o(torch.randn(4, 7))  # the model itself rejects this: raise, don't degrade
    assert o.kiln_report.active == "compiled full graph (float32)" and o.kiln_report.fallbacks == []
    Flaky.fail = True
    with pytest.warns(UserWarning, match="recompile crashed"):
        y = o(x)
    assert o.kiln_report.active == "eager passes (float32)"
    assert "recompile crashed" in o.kiln_report.fallbacks[0].reason
    torch.testing.assert_close(y, m(x), rtol=1e-4, atol=1e-5)


def test_autocast_knob_keeps_fp32_weights():
    if not tk.detect().cpu.bf16_native:
        pytest.skip("no native bf16 on this CPU")
    m, x = mlp(), torch.randn(8, 32)
    o = tk.optimize(m, dtype="bf16", autocast=True, sample_input=x, graph_mode=False)
    r = o.kiln_recipe
    assert r.dtype_mode == "autocast" and "cast_dtype" not in r.passes and r.fp32_modules == ()
    ref = m(x)
    assert 0 < ((o(x) - ref).norm() / ref.norm()).item() < 5e-2  # bf16-sized error, not zero
