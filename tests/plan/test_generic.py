"""Other accelerators (xpu, mps): the conservative generic recipe."""

import dataclasses

import pytest

from torchkiln.passes.cast_dtype import DEFAULT_FP32_MODULES
from torchkiln.plan import cpu, cuda, family, generic, plan

from .fakes import BF16, FP32, MPS, XPU, cnn, mlp

GEN = pytest.mark.parametrize("hw,device", [(XPU, "xpu:0"), (MPS, "mps:0")], ids=["xpu", "mps"])
LEVEL = pytest.mark.parametrize("level", ["O1", "O2"])


@pytest.mark.parametrize("device,mod", [("cpu", cpu), ("cuda:0", cuda), ("cuda", cuda), ("xpu:0", generic),
                                        ("mps", generic), ("meta", generic)])
def test_family_dispatch(device, mod):
    assert family(device) is mod


@GEN
@LEVEL
def test_generic_recipe(hw, device, level):
    recipe = plan(mlp(), hw, device, FP32, level, {}, batch=8)
    assert recipe.compile is True
    assert recipe.compile_options == (("freezing", True),)  # same at O1 and O2, no CUDA or CPU options
    assert recipe.attention == "sdpa"
    assert recipe.cuda_graphs is False and recipe.cudnn_benchmark is False
    assert any("generic recipe" in n for n in recipe.notes)


@GEN
@LEVEL
def test_bf16_where_the_probe_saw_it(hw, device, level):
    recipe = plan(mlp(), hw, device, BF16, level, {}, None)
    assert recipe.dtype == "bfloat16" and recipe.dtype_mode == "cast"
    assert recipe.fp32_modules == DEFAULT_FP32_MODULES


@GEN
@pytest.mark.parametrize("bf16,expect", [(False, "float32"), (None, "bfloat16")], ids=["no-bf16", "unknown"])
def test_bf16_fallback_on_generic(hw, device, bf16, expect):
    acc = dataclasses.replace(hw.accelerators[0], bf16=bf16)
    recipe = plan(mlp(), dataclasses.replace(hw, accelerators=(acc,)), device, BF16, "O1", {}, None)
    assert recipe.dtype == expect
    if expect == "float32":
        assert "does not run it natively" in recipe.notes[0]


@LEVEL
def test_channels_last_on_xpu_not_on_mps(level):
    xpu = plan(cnn(), XPU, "xpu:0", FP32, level, {}, None)
    assert xpu.memory_format == "channels_last" and "channels_last" in xpu.pass_names
    mps = plan(cnn(), MPS, "mps:0", FP32, level, {}, None)
    assert mps.memory_format == "contiguous" and "channels_last" not in mps.pass_names
    assert "fold_conv_bn" in mps.pass_names
