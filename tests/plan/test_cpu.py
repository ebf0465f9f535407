"""CPU planner: native-bf16 gating, measured oneDNN vs aten GEMM, inductor options."""

import dataclasses

import pytest
import torch
from torch import nn

from torchkiln.passes.cast_dtype import DEFAULT_FP32_MODULES
from torchkiln.plan import plan

from .fakes import ARM_BF16, BF16, FP32, X86_BF16, X86_NO_BF16, cnn, cpu_info, machine, mlp

BF16_CPUS = pytest.mark.parametrize("hw", [X86_BF16, ARM_BF16], ids=["x86-avx512bf16", "arm-bf16"])
LEVEL = pytest.mark.parametrize("level", ["O1", "O2"])


def linears() -> nn.Module:
    """Most common large shape: 48x48 (twice), so the typical GEMM is unambiguous."""
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 48),
                         nn.ReLU(), nn.Linear(48, 16)).eval()


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_bf16_without_native_support_stays_fp32(level):
    recipe = plan(mlp(), X86_NO_BF16, "cpu", BF16, level, {}, None)
    assert recipe.dtype == "float32" and recipe.dtype_mode == "none"
    assert "cast_dtype" not in recipe.pass_names
    assert "no native bf16" in recipe.notes[0]


@BF16_CPUS
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_bf16_on_native_cpu_casts_with_fp32_islands(hw, level):
    recipe = plan(mlp(), hw, "cpu", BF16, level, {}, None)
    assert recipe.dtype == "bfloat16" and recipe.dtype_mode == "cast"
    cast = recipe.pass_config("cast_dtype")
    assert cast is not None and cast.dtype == "bfloat16"
    assert recipe.fp32_modules == DEFAULT_FP32_MODULES and "LayerNorm" in recipe.fp32_modules
    assert not any("no native bf16" in n for n in recipe.notes)


@pytest.mark.parametrize("features", [("avx2",), ("avx512_bf16",), ("amx_bf16",), ("bf16",)])
def test_bf16_native_features(features):
    hw = machine(cpu_info(features=features))
    expect = "float32" if features == ("avx2",) else "bfloat16"
    assert plan(mlp(), hw, "cpu", BF16, "O1", {}, None).dtype == expect


@pytest.mark.parametrize("features,expect", [(("avx512_bf16",), "float32"), (("avx512_fp16",), "float16"),
                                             (("amx_fp16",), "float16"), (("neon_fp16",), "float16")])
def test_fp16_needs_native_fp16(features, expect):
    recipe = plan(mlp(), machine(cpu_info(features=features)), "cpu", torch.float16, "O1", {}, None)
    assert recipe.dtype == expect
    if expect == "float32":
        assert "float16 requested" in recipe.notes[0]
    else:
        assert recipe.pass_config("cast_dtype").dtype == "float16"


@LEVEL
def test_cpu_attention_auto_no_gpu_flags(level):
    recipe = plan(cnn(), X86_BF16, "cpu", FP32, level, {}, batch=8)
    assert recipe.attention == "auto"
    assert recipe.cuda_graphs is False and recipe.cudnn_benchmark is False
    assert "triton.cudagraphs" not in dict(recipe.compile_options)
    assert "max_autotune" not in dict(recipe.compile_options)


@LEVEL
def test_onednn_measured_faster_adds_onednn_linear_with_its_numbers(gemm, level):
    gemm.answer = "onednn"
    recipe = plan(linears(), X86_NO_BF16, "cpu", FP32, level, {}, None)
    assert gemm.calls == [(FP32, 128, 48, 48)]
    assert recipe.gemm == "onednn"
    cfg = recipe.pass_config("onednn_linear")
    assert cfg.shape == (128, 48, 48)
    assert (cfg.aten_gflops, cfg.onednn_gflops) == (200.0, 500.0)
    assert any("measured" in n and "-> onednn" in n for n in recipe.notes)


@LEVEL
def test_aten_measured_faster_no_onednn_linear(gemm, level):
    gemm.answer = "aten"
    recipe = plan(linears(), X86_NO_BF16, "cpu", FP32, level, {}, None)
    assert len(gemm.calls) == 1
    assert recipe.gemm == "aten" and "onednn_linear" not in recipe.pass_names
    assert any("-> aten" in n for n in recipe.notes)


def test_onednn_unavailable_means_aten_and_no_numbers(monkeypatch):
    from torchkiln.plan import cpu as cpu_plan

    monkeypatch.setattr(cpu_plan, "gemm_choice", lambda dtype, m, k, n: ("aten", {}))
    recipe = plan(linears(), X86_NO_BF16, "cpu", FP32, "O1", {}, None)
    assert recipe.gemm == "aten"
    assert not any("measured" in n for n in recipe.notes)


@pytest.mark.parametrize("batch,m", [(None, 128), (1, 16), (16, 16), (64, 64), (100_000, 4096)])
def test_gemm_measured_at_the_batch_size_clamped(gemm, batch, m):
    gemm.answer = "onednn"
    recipe = plan(linears(), X86_NO_BF16, "cpu", FP32, "O1", {}, batch)
    assert gemm.calls == [(FP32, m, 48, 48)]
    assert recipe.pass_config("onednn_linear").shape == (m, 48, 48)


@pytest.mark.parametrize("batch,rows,m", [(4, 256, 256), (1, 128, 128), (2, 8, 16), (4, None, 16)])
def test_gemm_measured_at_the_rows_a_text_model_sees(gemm, batch, rows, m):
    """A text model's linears see batch x sequence rows: measured at the batch alone (16 for 4 x 64
    tokens), the planner chose aten where oneDNN was 1.84x at the real 256 rows (a 256-wide BERT,
    2-core Zen 5; RESULTS.md, twenty-eighth session)."""
    gemm.answer = "onednn"
    recipe = plan(linears(), X86_NO_BF16, "cpu", FP32, "O1", {}, batch, rows=rows)
    assert gemm.calls == [(FP32, m, 48, 48)]
    assert recipe.pass_config("onednn_linear").shape == (m, 48, 48)


@BF16_CPUS
def test_low_precision_leaves_gemm_to_inductor_no_measurement(gemm, hw):
    gemm.answer = "onednn"
    recipe = plan(linears(), hw, "cpu", BF16, "O1", {}, None)
    assert gemm.calls == []
    assert "onednn_linear" not in recipe.pass_names
    assert any("inductor freezing" in n for n in recipe.notes)


@BF16_CPUS
@pytest.mark.parametrize("answer", ["onednn", "aten"])
def test_low_precision_without_compiling_measures_its_gemm(gemm, hw, answer):
    """graph_mode=False (IPEX's eager mode): no freezing packs the bf16 linears, so the eager passes
    do where oneDNN measured faster; the note says what was measured, not that inductor packs them."""
    gemm.answer = answer
    recipe = plan(linears(), hw, "cpu", BF16, "O1", {"graph_mode": False}, 64)
    assert gemm.calls == [(BF16, 64, 48, 48)]
    assert recipe.compile is False and recipe.gemm == answer
    if answer == "onednn":
        assert recipe.pass_config("onednn_linear").shape == (64, 48, 48)
        assert recipe.pass_names.index("cast_dtype") < recipe.pass_names.index("onednn_linear")  # packs bf16
    assert any(f"-> {answer}" in n for n in recipe.notes)
    assert not any("inductor freezing" in n for n in recipe.notes)


@pytest.mark.parametrize("knob", ["weights_prepack", "auto_kernel_selection"])
def test_low_precision_without_compiling_keeps_the_gemm_knobs_off(gemm, knob):
    gemm.answer = "onednn"
    recipe = plan(linears(), X86_BF16, "cpu", BF16, "O1", {"graph_mode": False, knob: False}, 64)
    assert gemm.calls == [] and "onednn_linear" not in recipe.pass_names


def test_float32_without_compiling_measures_once(gemm):
    gemm.answer = "onednn"
    recipe = plan(linears(), X86_BF16, "cpu", FP32, "O1", {"graph_mode": False}, 64)
    assert gemm.calls == [(FP32, 64, 48, 48)] and recipe.gemm == "onednn"


def test_gpt2s_conv1d_layers_are_the_typical_gemm(gemm):
    """transformers' Conv1D stores (in, out): GPT-2 has no nn.Linear but its head, so its GEMM was
    measured at the head's shape (or not at all) and its layers never routed."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)
    gemm.answer = "onednn"
    recipe = plan(transformers.GPT2Model(cfg).eval(), X86_BF16, "cpu", FP32, "O1", {}, 1, rows=32)
    # c_fc (64 -> 256) and mlp.c_proj (256 -> 64) weigh the most, equally; attention's are smaller
    assert gemm.calls in ([(FP32, 32, 64, 256)], [(FP32, 32, 256, 64)])
    assert recipe.gemm == "onednn"


def test_no_linear_no_measurement(gemm):
    gemm.answer = "onednn"
    convs = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).eval()
    recipe = plan(convs, X86_NO_BF16, "cpu", FP32, "O1", {}, None)
    assert gemm.calls == [] and "onednn_linear" not in recipe.pass_names


def test_conv_net_note_and_layout():
    recipe = plan(cnn(), X86_BF16, "cpu", BF16, "O1", {}, None)
    assert recipe.pass_names[-2:] == ("cast_dtype", "channels_last")
    assert recipe.memory_format == "channels_last"
    assert any("channels_last" in n for n in recipe.notes)


def test_O1_no_concat_no_cpp_wrapper(gemm):
    recipe = plan(linears(), X86_NO_BF16, "cpu", FP32, "O1", {}, None)
    assert "concat_linear" not in recipe.pass_names
    assert dict(recipe.compile_options) == {"freezing": True}


@pytest.mark.parametrize("hw,dtype", [(X86_NO_BF16, FP32), (X86_BF16, BF16), (ARM_BF16, BF16)],
                         ids=["fp32", "x86-bf16", "arm-bf16"])
def test_O2_aten_gemm_concat_and_cpp_wrapper(gemm, hw, dtype):
    gemm.answer = "aten"
    recipe = plan(linears(), hw, "cpu", dtype, "O2", {}, None)
    assert "concat_linear" in recipe.pass_names
    assert dict(recipe.compile_options) == {"freezing": True, "cpp_wrapper": True}


def test_O2_onednn_gemm_has_no_cpp_wrapper(gemm):
    gemm.answer = "onednn"
    recipe = plan(linears(), X86_NO_BF16, "cpu", FP32, "O2", {}, None)
    assert "onednn_linear" in recipe.pass_names and "concat_linear" in recipe.pass_names
    assert "cpp_wrapper" not in dict(recipe.compile_options)


def test_detected_machine_with_bf16_added_is_planned_bf16():
    """dataclasses.replace on a real detect() result, the way optimize() tests fake a CPU."""
    import torchkiln

    hw = torchkiln.detect()
    with_bf16 = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, features=(*hw.cpu.features, "avx512_bf16")))
    without = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, features=tuple(
        f for f in hw.cpu.features if f not in ("avx512_bf16", "amx_bf16", "bf16"))))
    assert plan(mlp(), with_bf16, "cpu", BF16, "O1", {}, None).dtype == "bfloat16"
    assert plan(mlp(), without, "cpu", BF16, "O1", {}, None).dtype == "float32"


def test_gemm_choice_is_measured_per_thread_count(monkeypatch):
    # tk.runtime streams run the model with fewer threads than optimize() planned with.
    from torchkiln.plan import cpu as cpu_plan

    monkeypatch.undo()  # the real gemm_choice, not conftest's stand-in; the measurement is faked below
    calls = []
    monkeypatch.setattr(cpu_plan, "onednn_available", lambda dtype: True)
    monkeypatch.setattr(cpu_plan, "onednn_measure",
                        lambda dtype, m, k, n: calls.append(torch.get_num_threads()) or {"onednn": 2.0, "aten": 1.0})
    cpu_plan._gemm_choice.cache_clear()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            assert cpu_plan.gemm_choice(torch.float32, 8, 64, 64)[0] == "onednn"
    finally:
        torch.set_num_threads(threads)
        cpu_plan._gemm_choice.cache_clear()
    assert calls == [1, 2]  # the third call (1 thread again) came from the cache


def test_onednn_graph_candidate_for_conv_nets_only(monkeypatch):
    from torchkiln.passes import onednn_graph
    from torchkiln.recipe import Recipe

    monkeypatch.setattr(onednn_graph, "available", lambda: True)
    conv = plan(cnn(), X86_NO_BF16, "cpu", FP32, "O1", {}, None)
    assert conv.onednn_graph and any("oneDNN Graph" in n for n in conv.notes)
    assert Recipe.from_dict(conv.to_dict()).onednn_graph  # survives the JSON round trip
    assert not plan(mlp(), X86_NO_BF16, "cpu", FP32, "O1", {}, None).onednn_graph
    assert not plan(cnn(), X86_NO_BF16, "cpu", FP32, "O1", {"onednn_graph": False}, None).onednn_graph
    assert not plan(cnn(), X86_NO_BF16, "cpu", FP32, "O1", {"graph_mode": False}, None).onednn_graph
    monkeypatch.setattr(onednn_graph, "available", lambda: False)
    assert not plan(cnn(), X86_NO_BF16, "cpu", FP32, "O1", {}, None).onednn_graph
    off = plan(cnn(), X86_NO_BF16, "cpu", FP32, "O1", {"onednn_graph": True}, None)
    assert not off.onednn_graph and any("onednn_graph=True ignored" in n for n in off.notes)


def big() -> nn.Module:
    """Above WRAPPER_MIN_PARAMS (16.8M parameters), built on the meta device: nothing allocated."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()).eval()


@BF16_CPUS
def test_cpp_wrapper_for_large_low_precision_models(hw):
    from torchkiln.plan.cpu import WRAPPER_MIN_PARAMS

    assert sum(p.numel() for p in big().parameters()) >= WRAPPER_MIN_PARAMS
    opts = dict(plan(big(), hw, "cpu", BF16, "O1", {}, None).compile_options)
    assert opts.get("cpp_wrapper") is True
    # A small model (compile cost would dominate), and float32, keep the Python wrapper at O1.
    assert "cpp_wrapper" not in dict(plan(mlp(), hw, "cpu", BF16, "O1", {}, None).compile_options)
    assert "cpp_wrapper" not in dict(plan(big(), hw, "cpu", FP32, "O1", {}, None).compile_options)
