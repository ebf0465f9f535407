"""Across device families and levels: what every recipe must satisfy."""

import json

import pytest
import torch
from torch import nn

from torchkiln.passes import registry
from torchkiln.plan import plan
from torchkiln.recipe import Recipe

from .fakes import BF16, CPUS, FP32, GENERIC, GPUS, LEVELS, MACHINES, bert, cnn, mlp

ALL = pytest.mark.parametrize("hw,device", [m[1:] for m in MACHINES], ids=[m[0] for m in MACHINES])
LEVEL = pytest.mark.parametrize("level", LEVELS)
DTYPE = pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
MODEL = pytest.mark.parametrize("make", [mlp, cnn], ids=["mlp", "cnn"])


@ALL
@LEVEL
@DTYPE
@MODEL
def test_recipe_round_trips_through_json(hw, device, level, dtype, make, gemm):
    gemm.answer = "onednn"  # so CPU fp32 recipes carry an onednn_linear config with its numbers
    recipe = plan(make(), hw, device, dtype, level, {}, batch=8)
    back = Recipe.from_dict(json.loads(recipe.to_json()))
    assert back == recipe
    assert back.notes == recipe.notes  # notes are compare=False: check them separately
    assert back.passes == recipe.passes


@ALL
@LEVEL
@DTYPE
@MODEL
def test_pass_names_in_registry_order(hw, device, level, dtype, make, gemm):
    gemm.answer = "onednn"
    recipe = plan(make(), hw, device, dtype, level, {"concat_linear": True}, batch=None)
    order = registry.names()
    assert list(recipe.pass_names) == sorted(recipe.pass_names, key=order.index)
    assert len(set(recipe.pass_names)) == len(recipe.pass_names)


@ALL
@LEVEL
def test_recipe_records_device_level_and_dtype(hw, device, level):
    recipe = plan(mlp(), hw, device, FP32, level, {}, None)
    assert (recipe.device, recipe.level, recipe.dtype, recipe.dtype_mode) == (device, level, "float32", "none")
    assert "cast_dtype" not in recipe.pass_names


@ALL
@DTYPE
@MODEL
def test_O0_no_compile_and_only_cast(hw, device, dtype, make):
    recipe = plan(make(), hw, device, dtype, "O0", {}, batch=8)
    assert recipe.compile is False
    assert not recipe.cuda_graphs and not recipe.cudnn_benchmark
    assert recipe.attention == "sdpa" and not recipe.drop_all_ones_mask
    assert recipe.memory_format == "contiguous"
    if recipe.dtype == "float32":
        assert recipe.pass_names == () and recipe.dtype_mode == "none"
    else:
        assert recipe.pass_names == ("cast_dtype",) and recipe.dtype_mode == "cast"
        assert recipe.pass_config("cast_dtype").dtype == recipe.dtype
    assert any(n.startswith("O0:") for n in recipe.notes)


@pytest.mark.parametrize("hw,device", [m[1:] for m in CPUS + GPUS], ids=[m[0] for m in CPUS + GPUS])
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_dtype_fallback_reason_is_the_first_note(hw, device, level):
    """optimize() warns with notes[0] when the recipe's dtype differs from the one asked for."""
    recipe = plan(mlp(), hw, device, BF16, level, {}, None)
    if recipe.dtype == "float32":
        assert "bfloat16 requested" in recipe.notes[0] and "kept float32" in recipe.notes[0]
    else:
        assert recipe.dtype == "bfloat16"
        assert not any("kept float32" in n for n in recipe.notes)


@pytest.mark.parametrize("hw,device", [m[1:] for m in CPUS + GPUS], ids=[m[0] for m in CPUS + GPUS])
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_a_model_already_in_bf16_is_planned_in_bf16_everywhere(hw, device, level):
    """Weights already bf16 (a checkpoint loaded in bf16): no upcast to float32, even where bf16 is
    emulated; the note says so. (A float32 plan left the candidates in bf16 under float32's
    tolerance: on a Zen 3 none passed and the original served.)"""
    recipe = plan(mlp().to(BF16), hw, device, BF16, level, {}, None)
    assert recipe.dtype == "bfloat16"
    assert not any("kept float32" in n for n in recipe.notes)
    if plan(mlp(), hw, device, BF16, level, {}, None).dtype == "float32":  # a float32 model would step down
        assert "weights are bfloat16: planned at that precision" in recipe.notes[0]


@ALL
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_O1_O2_compile_with_freezing_and_base_passes(hw, device, level):
    recipe = plan(mlp(), hw, device, FP32, level, {}, None)
    assert recipe.compile is True
    assert dict(recipe.compile_options)["freezing"] is True
    assert {"replace_dropout", "fold_conv_bn", "fold_linear_bn"} <= set(recipe.pass_names)


@pytest.mark.parametrize("hw,device,fmt", [
    (CPUS[0][1], "cpu", "channels_last"),
    (CPUS[1][1], "cpu", "channels_last"),
    (CPUS[2][1], "cpu", "channels_last"),
    (GPUS[0][1], "cuda:0", "channels_last"),
    (GPUS[1][1], "cuda:0", "channels_last"),
    (GENERIC[0][1], "xpu:0", "channels_last"),
    (GENERIC[1][1], "mps:0", "contiguous"),
], ids=[m[0] for m in MACHINES])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_conv_net_layout(hw, device, fmt, level):
    recipe = plan(cnn(), hw, device, FP32, level, {}, None)
    assert recipe.memory_format == fmt
    assert ("channels_last" in recipe.pass_names) == (fmt == "channels_last")
    # a net without convolutions never changes layout
    flat = plan(mlp(), hw, device, FP32, level, {}, None)
    assert flat.memory_format == "contiguous" and "channels_last" not in flat.pass_names
    # nor one whose only convolutions are 1-D (whisper's and wav2vec2's audio stems): no such layout,
    # and the report said both "conv net: channels_last" and "channels_last (no convolutions)"
    audio = nn.Sequential(nn.Conv1d(4, 8, 3), nn.GELU(), nn.Flatten(), nn.Linear(8 * 14, 2)).eval()
    one_d = plan(audio, hw, device, FP32, level, {}, None)
    assert one_d.memory_format == "contiguous" and "channels_last" not in one_d.pass_names
    assert not any("channels_last" in n for n in one_d.notes)
    assert one_d.cudnn_benchmark is device.startswith("cuda")  # cuDNN still picks its 1-D algorithms


@ALL
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_cudnn_benchmark_only_for_cuda_conv_nets(hw, device, level):
    is_cuda = device.startswith("cuda")
    assert plan(cnn(), hw, device, FP32, level, {}, None).cudnn_benchmark is is_cuda
    assert plan(mlp(), hw, device, FP32, level, {}, None).cudnn_benchmark is False


@pytest.fixture(scope="module")
def tiny_bert():
    return bert()


@pytest.mark.parametrize("hw,device", [m[1:] for m in CPUS + GPUS], ids=[m[0] for m in CPUS + GPUS])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_drop_all_ones_mask_for_transformers_models(hw, device, level, tiny_bert):
    assert plan(tiny_bert, hw, device, FP32, level, {}, None).drop_all_ones_mask is True
    plain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    assert plan(plain, hw, device, FP32, level, {}, None).drop_all_ones_mask is False


@pytest.mark.parametrize("hw,device", [m[1:] for m in CPUS + GPUS], ids=[m[0] for m in CPUS + GPUS])
def test_tiny_bert_recipe_round_trips(hw, device, tiny_bert):
    recipe = plan(tiny_bert, hw, device, BF16, "O2", {}, batch=4)
    assert Recipe.from_dict(json.loads(recipe.to_json())) == recipe


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="level"):
        plan(mlp(), CPUS[0][1], "cpu", FP32, "O3", {}, None)


def test_plan_does_not_touch_the_model():
    model = cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    plan(model, CPUS[0][1], "cpu", BF16, "O2", {}, batch=2)
    assert [type(m) for m in model.modules()] == kinds
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype for k in before)
