"""CUDA planner (fake GPUs: nothing here runs on a GPU, so no `cuda` marker)."""

import pytest
import torch

from torchkiln.plan import plan

from .fakes import BF16, FP32, H100, V100, cnn, mlp

DEV = "cuda:0"
LEVEL = pytest.mark.parametrize("level", ["O1", "O2"])


@LEVEL
def test_bf16_on_sm90_casts_without_fp32_islands(level):
    recipe = plan(mlp(), H100, DEV, BF16, level, {}, None)
    assert recipe.dtype == "bfloat16" and recipe.dtype_mode == "cast"
    assert recipe.pass_config("cast_dtype").dtype == "bfloat16"
    assert recipe.pass_config("cast_dtype").fp32_modules == ()
    assert recipe.fp32_modules == ()


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_bf16_on_sm70_stays_fp32(level):
    recipe = plan(mlp(), V100, DEV, BF16, level, {}, None)
    assert recipe.dtype == "float32" and recipe.dtype_mode == "none"
    assert "cast_dtype" not in recipe.pass_names
    assert "does not run it natively" in recipe.notes[0] and "7.0" in recipe.notes[0]


@LEVEL
def test_fp16_on_sm70_is_native(level):
    recipe = plan(mlp(), V100, DEV, torch.float16, level, {}, None)
    assert recipe.dtype == "float16"
    assert recipe.pass_config("cast_dtype").dtype == "float16" and recipe.fp32_modules == ()


def test_device_spelled_without_index_finds_the_gpu():
    assert plan(mlp(), V100, "cuda", BF16, "O1", {}, None).dtype == "float32"


@LEVEL
def test_attention_opaque(level):
    assert plan(mlp(), H100, DEV, FP32, level, {}, None).attention == "opaque"


@LEVEL
def test_cuda_graphs_only_with_fixed_shapes(level):
    no_sample = plan(mlp(), H100, DEV, BF16, level, {}, batch=None)
    assert no_sample.cuda_graphs is False
    assert "triton.cudagraphs" not in dict(no_sample.compile_options)
    sample = plan(mlp(), H100, DEV, BF16, level, {}, batch=8)
    assert sample.cuda_graphs is True
    assert dict(sample.compile_options)["triton.cudagraphs"] is True


def test_O2_adds_max_autotune_O1_does_not():
    o1 = dict(plan(mlp(), H100, DEV, BF16, "O1", {}, None).compile_options)
    o2 = dict(plan(mlp(), H100, DEV, BF16, "O2", {}, None).compile_options)
    assert o1 == {"freezing": True}
    assert o2 == {"freezing": True, "max_autotune": True}


@LEVEL
def test_no_cpu_only_choices_on_cuda(gemm, level):
    gemm.answer = "onednn"
    recipe = plan(mlp(), H100, DEV, FP32, level, {}, batch=8)
    assert gemm.calls == []
    assert "onednn_linear" not in recipe.pass_names
    assert "cpp_wrapper" not in dict(recipe.compile_options)


def test_concat_linear_only_with_a_sample_and_no_convs():
    # It needs the sample run, and is there for the attention op's input strides.
    assert "concat_linear" in plan(mlp(), H100, DEV, BF16, "O1", {}, batch=8).pass_names
    assert "concat_linear" not in plan(mlp(), H100, DEV, BF16, "O1", {}, None).pass_names
    assert "concat_linear" not in plan(cnn(), H100, DEV, BF16, "O1", {}, batch=8).pass_names


@LEVEL
def test_conv_net_channels_last_and_cudnn_benchmark(level):
    recipe = plan(cnn(), H100, DEV, BF16, level, {}, None)
    assert recipe.memory_format == "channels_last" and "channels_last" in recipe.pass_names
    assert recipe.cudnn_benchmark is True
    assert plan(mlp(), H100, DEV, BF16, level, {}, None).cudnn_benchmark is False


def test_O0_cast_on_cuda_matches_family_islands():
    assert plan(mlp(), H100, DEV, BF16, "O0", {}, None).fp32_modules == ()


@LEVEL
def test_gelu_epilogue_in_half_precision_only(level):
    # cuBLASLt's tanh-form GELU is within ~5e-4 of the exact one: fine under bf16/fp16's rounding,
    # not under float32's 1e-4 bar
    assert "gelu_epilogue" in plan(mlp(), H100, DEV, BF16, level, {}, batch=8).pass_names
    assert "gelu_epilogue" in plan(mlp(), V100, DEV, torch.float16, level, {}, None).pass_names
    assert "gelu_epilogue" not in plan(mlp(), H100, DEV, FP32, level, {}, batch=8).pass_names
    assert "gelu_epilogue" not in plan(mlp(), V100, DEV, BF16, level, {}, None).pass_names  # served fp32


@LEVEL
def test_few_channel_convs_padded_in_half_precision_conv_nets_only(level):
    # the tensor-core conv kernels want 8 input channels (H200 resnet50 bf16 bs256: 10.11 -> 9.98 ms)
    assert "pad_conv_channels" in plan(cnn(), H100, DEV, BF16, level, {}, None).pass_names
    assert "pad_conv_channels" in plan(cnn(), V100, DEV, torch.float16, level, {}, None).pass_names
    assert "pad_conv_channels" not in plan(cnn(), H100, DEV, FP32, level, {}, None).pass_names
    assert "pad_conv_channels" not in plan(mlp(), H100, DEV, BF16, level, {}, None).pass_names
