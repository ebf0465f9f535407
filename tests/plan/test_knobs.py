"""ipex.optimize-style knobs applied on top of the family's plan, and their conflicts."""

import itertools

import pytest
import torch

from torchkiln.plan import plan

from .fakes import BF16, FP32, GPUS, H100, MACHINES, X86_BF16, X86_NO_BF16, XPU, cnn, mlp

ALL = pytest.mark.parametrize("hw,device", [m[1:] for m in MACHINES], ids=[m[0] for m in MACHINES])
CPU_GPU = pytest.mark.parametrize("hw,device", [(X86_NO_BF16, "cpu"), (H100, "cuda:0")], ids=["cpu", "sm90"])
LEVEL = pytest.mark.parametrize("level", ["O1", "O2"])


def opts(recipe) -> dict:
    return dict(recipe.compile_options)


@CPU_GPU
@LEVEL
@pytest.mark.parametrize("knob,pass_name", [("conv_bn_folding", "fold_conv_bn"),
                                            ("linear_bn_folding", "fold_linear_bn"),
                                            ("replace_dropout_with_identity", "replace_dropout")])
def test_folding_knobs_false_remove_their_pass(hw, device, level, knob, pass_name):
    assert pass_name in plan(cnn(), hw, device, FP32, level, {}, None).pass_names
    recipe = plan(cnn(), hw, device, FP32, level, {knob: False}, None)
    assert pass_name not in recipe.pass_names
    assert f"{knob}=False: {pass_name} off" in recipe.notes


@CPU_GPU
def test_knob_none_changes_nothing(hw, device):
    base = plan(cnn(), hw, device, FP32, "O1", {}, None)
    knobs = dict.fromkeys(("conv_bn_folding", "weights_prepack", "graph_mode", "compile_options", "autocast"))
    assert plan(cnn(), hw, device, FP32, "O1", knobs, None) == base


@CPU_GPU
def test_intel_only_and_training_knobs_do_not_change_the_inference_plan(hw, device):
    base = plan(mlp(), hw, device, BF16, "O2", {}, batch=4)
    knobs = {"optimize_lstm": True, "split_master_weight_for_bf16": True, "fuse_update_step": True}
    assert plan(mlp(), hw, device, BF16, "O2", knobs, batch=4) == base


def test_concat_linear_knob_both_ways():
    assert "concat_linear" in plan(mlp(), X86_NO_BF16, "cpu", FP32, "O1", {"concat_linear": True}, None).pass_names
    assert "concat_linear" not in plan(mlp(), X86_NO_BF16, "cpu", FP32, "O2", {"concat_linear": False},
                                       None).pass_names


@ALL
@LEVEL
def test_graph_mode_false_means_no_compile(hw, device, level):
    recipe = plan(mlp(), hw, device, FP32, level, {"graph_mode": False}, None)
    assert recipe.compile is False


def test_graph_mode_true_compiles_even_at_O0():
    assert plan(mlp(), X86_NO_BF16, "cpu", FP32, "O0", {"graph_mode": True}, None).compile is True


@LEVEL
def test_auto_kernel_selection_false_removes_onednn_linear(gemm, level):
    gemm.answer = "onednn"
    assert "onednn_linear" in plan(mlp(), X86_NO_BF16, "cpu", FP32, level, {}, None).pass_names
    recipe = plan(mlp(), X86_NO_BF16, "cpu", FP32, level, {"auto_kernel_selection": False}, None)
    assert "onednn_linear" not in recipe.pass_names and recipe.gemm == "aten"


def test_weights_prepack_false_removes_measured_onednn_linear(gemm):
    gemm.answer = "onednn"
    recipe = plan(mlp(), X86_NO_BF16, "cpu", FP32, "O1", {"weights_prepack": False}, None)
    assert recipe.gemm == "aten"


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_weights_prepack_true_forces_onednn_linear_on_cpu(gemm, dtype):
    gemm.answer = "aten"
    recipe = plan(mlp(), X86_BF16, "cpu", dtype, "O1", {"weights_prepack": True}, None)
    assert recipe.gemm == "onednn"
    assert recipe.pass_config("onednn_linear").shape == ()  # forced, not measured
    assert "weights_prepack=True: onednn_linear forced on" in recipe.notes


@pytest.mark.parametrize("hw,device", [*[m[1:] for m in GPUS], (XPU, "xpu:0")], ids=["sm90", "sm70", "xpu"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_weights_prepack_ignored_off_cpu_with_a_note(hw, device, level):
    recipe = plan(mlp(), hw, device, FP32, level, {"weights_prepack": True}, None)
    assert "onednn_linear" not in recipe.pass_names
    assert any("weights_prepack ignored" in n for n in recipe.notes)


# --- cpp_wrapper vs prepacked oneDNN weights: inductor asserts on the pair, so never both ---

def test_O2_cpu_sets_cpp_wrapper_normally(gemm):
    gemm.answer = "aten"
    assert opts(plan(mlp(), X86_NO_BF16, "cpu", FP32, "O2", {}, None))["cpp_wrapper"] is True


def test_O2_weights_prepack_drops_cpp_wrapper(gemm):
    gemm.answer = "aten"
    recipe = plan(mlp(), X86_NO_BF16, "cpu", FP32, "O2", {"weights_prepack": True}, None)
    assert "onednn_linear" in recipe.pass_names
    assert "cpp_wrapper" not in opts(recipe)
    assert any("cpp_wrapper off" in n for n in recipe.notes)


def test_O2_measured_onednn_has_no_cpp_wrapper(gemm):
    gemm.answer = "onednn"
    recipe = plan(mlp(), X86_NO_BF16, "cpu", FP32, "O2", {}, None)
    assert "onednn_linear" in recipe.pass_names and "cpp_wrapper" not in opts(recipe)


@pytest.mark.parametrize("level,answer,prepack,user_cpp,dtype", list(itertools.product(
    ["O0", "O1", "O2"], ["aten", "onednn"], [None, True, False], [None, True], [FP32, BF16])))
def test_never_onednn_linear_with_cpp_wrapper(gemm, level, answer, prepack, user_cpp, dtype):
    gemm.answer = answer
    knobs = {"weights_prepack": prepack}
    if user_cpp:
        knobs["compile_options"] = {"cpp_wrapper": True}
    recipe = plan(mlp(), X86_BF16, "cpu", dtype, level, knobs, batch=8)
    assert not ("onednn_linear" in recipe.pass_names and opts(recipe).get("cpp_wrapper"))


@pytest.mark.parametrize("knob", [{"auto_kernel_selection": False}, {"weights_prepack": False}])
def test_O2_knob_removing_onednn_restores_cpp_wrapper(gemm, knob):
    gemm.answer = "onednn"
    recipe = plan(mlp(), X86_NO_BF16, "cpu", FP32, "O2", knob, None)
    assert recipe.gemm == "aten"
    assert opts(recipe).get("cpp_wrapper") is True


# --- compile_options ---

@pytest.mark.parametrize("batch", [None, 8])
def test_compile_options_cudagraphs_sets_cuda_graphs(batch):
    recipe = plan(mlp(), H100, "cuda:0", BF16, "O1", {"compile_options": {"triton.cudagraphs": True}}, batch)
    assert recipe.cuda_graphs is True and opts(recipe)["triton.cudagraphs"] is True


def test_compile_options_cudagraphs_false_turns_graphs_off():
    recipe = plan(mlp(), H100, "cuda:0", BF16, "O1", {"compile_options": {"triton.cudagraphs": False}}, 8)
    assert recipe.cuda_graphs is False and opts(recipe)["triton.cudagraphs"] is False


def test_compile_options_merge_over_the_plan():
    mine = {"max_autotune": False, "coordinate_descent_tuning": True}
    recipe = plan(mlp(), H100, "cuda:0", BF16, "O2", {"compile_options": mine}, 8)
    assert opts(recipe) == {"freezing": True, "triton.cudagraphs": True, **mine}
    assert list(recipe.compile_options) == sorted(recipe.compile_options)


@pytest.mark.parametrize("hw,device", [(X86_NO_BF16, "cpu"), (XPU, "xpu:0")], ids=["cpu", "xpu"])
def test_compile_options_cudagraphs_off_cuda_is_not_cuda_graphs(hw, device):
    recipe = plan(mlp(), hw, device, FP32, "O1", {"compile_options": {"triton.cudagraphs": True}}, 8)
    assert recipe.cuda_graphs is False


def test_graph_mode_false_has_no_cuda_graphs():
    recipe = plan(mlp(), H100, "cuda:0", BF16, "O1", {"graph_mode": False}, batch=8)
    assert recipe.compile is False
    assert recipe.cuda_graphs is False


# --- autocast ---

@pytest.mark.parametrize("hw,device", [(X86_BF16, "cpu"), (H100, "cuda:0"), (XPU, "xpu:0")],
                         ids=["cpu-bf16", "sm90", "xpu"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_autocast_with_bf16(hw, device, level):
    recipe = plan(mlp(), hw, device, BF16, level, {"autocast": True}, None)
    assert recipe.dtype == "bfloat16" and recipe.dtype_mode == "autocast"
    assert "cast_dtype" not in recipe.pass_names and recipe.fp32_modules == ()
    assert any("autocast=True" in n for n in recipe.notes)


@pytest.mark.parametrize("hw,dtype", [(X86_BF16, FP32), (X86_NO_BF16, BF16)], ids=["fp32", "bf16-fallback"])
def test_autocast_without_low_precision_is_a_no_op(hw, dtype):
    recipe = plan(mlp(), hw, "cpu", dtype, "O1", {"autocast": True}, None)
    assert recipe.dtype == "float32" and recipe.dtype_mode == "none"
    assert recipe == plan(mlp(), hw, "cpu", dtype, "O1", {}, None)


def test_fp16_autocast_on_cuda():
    recipe = plan(mlp(), H100, "cuda:0", torch.float16, "O1", {"autocast": True}, None)
    assert (recipe.dtype, recipe.dtype_mode) == ("float16", "autocast")
