"""plan(): hardware + model + knobs -> Recipe. Device-specific choices live in
one module per device family (cpu.py, cuda.py, generic.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..hardware import Hardware
from ..modelutil import model_dtype
from ..passes import onednn_graph, registry
from ..recipe import Recipe
from . import common, cpu, cuda, generic

# ipex.optimize keyword -> the registered pass it switches.
KNOB_PASSES = {
    "conv_bn_folding": "fold_conv_bn",
    "linear_bn_folding": "fold_linear_bn",
    "replace_dropout_with_identity": "replace_dropout",
    "concat_linear": "concat_linear",
    "weights_prepack": "onednn_linear",
}
KNOBS = (*KNOB_PASSES, "graph_mode", "auto_kernel_selection", "optimize_lstm",
         "split_master_weight_for_bf16", "fuse_update_step", "compile_options", "autocast",
         "onednn_graph", "cpu_allocator")
# Knobs with no vendor-neutral meaning: accepted, warned about once, ignored.
# (split_master_weight_for_bf16 and cpu_allocator are training's: training/recipe.py.)
INTEL_ONLY = ("optimize_lstm", "fuse_update_step")

_FAMILIES = {"cpu": cpu, "cuda": cuda}


def family(device: str):
    return _FAMILIES.get(torch.device(device).type, generic)


def plan(model: nn.Module, hw: Hardware, device: str, dtype: torch.dtype, level: str,
         knobs: dict, batch: int | None = None, rows: int | None = None) -> Recipe:
    notes: list[str] = []
    fam = family(device)
    chosen, why = fam.choose_dtype(hw, device, dtype)
    if chosen != dtype and model_dtype(model) == dtype:
        # the weights already are that dtype (a checkpoint loaded in bf16): computing them in float32
        # would be an upcast optimize() never makes (see its own-dtype rule), and the candidates, left in
        # bf16, were then held to float32's tolerance, so none passed (a bf16 model on a Zen 3)
        why = (f"the model's weights are {_name(dtype)}: planned at that precision, though this {device} has no "
               f"native {_name(dtype)} and emulates it; on a CPU a float32 copy competes too (answering in "
               f"{_name(dtype)}, at twice the weights' memory)")
    else:
        dtype = chosen
    if why:
        notes.append(why)
    has_conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    if level == "O0":
        low = dtype != torch.float32
        # the family's own cast (CUDA keeps no fp32 islands), so O0 differs from O1 only in what O1 adds
        passes = (common.cast_pass(dtype, getattr(fam, "FP32_ISLANDS", True)),) if low else ()
        # notes[0] stays the dtype reason (optimize() warns with it); O0's note follows.
        recipe = Recipe(device=device, level=level, dtype=_name(dtype), compile=False, passes=passes,
                        dtype_mode="cast" if low else "none",
                        notes=(*notes, "O0: no optimisation beyond the requested dtype"))
        return _apply_knobs(recipe, knobs)
    recipe = fam.plan(model, hw, device, dtype, level, has_conv, batch, notes, rows=rows)
    recipe = _apply_knobs(recipe.replace(dtype=_name(dtype), level=level), knobs)
    if fam is cpu and not recipe.compile and "onednn_linear" not in recipe.pass_names \
            and knobs.get("weights_prepack") is not False and knobs.get("auto_kernel_selection") is not False:
        # the linears of a recipe that will not compile are the eager passes' to pack (cpu.eager_gemm_pass)
        why: list[str] = []
        extra = cpu.eager_gemm_pass(model, dtype, rows or batch, why)
        if why:
            kept = tuple(n for n in recipe.notes if not n.startswith(cpu.FREEZING_GEMM))
            recipe = recipe.replace(passes=(*recipe.passes, *extra), notes=(*kept, *why))
    return recipe


# The knobs that still mean something for a tk.quantize'd model: its recipe has no module passes to
# switch, but it is compiled (graph_mode, compile_options) and may time a TorchScript candidate.
SERVING_KNOBS = ("graph_mode", "compile_options", "onednn_graph")


def serving_knobs(recipe: Recipe, knobs: dict) -> Recipe:
    """A quantized model's recipe with the serving knobs applied; ``onednn_graph=True`` cannot add the
    int8 modules candidate where the plan found no int8 convolution to lower, so it only keeps the plan's."""
    chosen = {k: knobs[k] for k in SERVING_KNOBS if knobs.get(k) is not None}
    if chosen.get("onednn_graph"):
        chosen.pop("onednn_graph")
    return _apply_knobs(recipe, chosen)


def _apply_knobs(recipe: Recipe, knobs: dict) -> Recipe:
    passes = {p.name: p for p in recipe.passes}
    notes = list(recipe.notes)
    changes: dict = {}
    for knob, pass_name in KNOB_PASSES.items():
        val = knobs.get(knob)
        if val is None:
            continue
        if val:
            passes.setdefault(pass_name, registry.make(pass_name))
            notes.append(f"{knob}=True: {pass_name} forced on")
        else:
            passes.pop(pass_name, None)
            notes.append(f"{knob}=False: {pass_name} off")
    if knobs.get("auto_kernel_selection") is False:
        passes.pop("onednn_linear", None)
        notes.append("auto_kernel_selection=False: stock aten GEMM path")
    if "onednn_linear" in passes and recipe.device != "cpu":
        passes.pop("onednn_linear")
        notes.append("weights_prepack ignored: oneDNN prepacking applies to CPU only")
    if knobs.get("graph_mode") is not None:
        changes["compile"] = bool(knobs["graph_mode"])
        if not knobs["graph_mode"]:
            changes["cuda_graphs"] = False  # CUDA graphs come from inductor here
            changes["onednn_graph"] = False
    if knobs.get("onednn_graph") is not None:
        on = bool(knobs["onednn_graph"]) and recipe.device == "cpu" and onednn_graph.available()
        changes["onednn_graph"] = on
        if on or not knobs["onednn_graph"]:
            notes.append(f"onednn_graph={bool(knobs['onednn_graph'])}: oneDNN Graph candidate {'timed' if on else 'off'}")
        else:
            notes.append("onednn_graph=True ignored: CPU only, and this torch build must have the oneDNN Graph fuser")
    opts = dict(recipe.compile_options)
    if knobs.get("compile_options"):
        _check_compile_options(knobs["compile_options"])
        opts.update(knobs["compile_options"])
        changes["cuda_graphs"] = bool(opts.get("triton.cudagraphs")) and recipe.device.startswith("cuda")
    if "onednn_linear" in passes and opts.get("cpp_wrapper"):
        # inductor's cpp_wrapper asserts oneDNN weights are graph constants; the packed
        # buffers of onednn_linear are not (InductorError on torch 2.13): never both.
        opts.pop("cpp_wrapper")
        notes.append("cpp_wrapper off: it cannot run oneDNN-prepacked linears")
    changes["compile_options"] = tuple(sorted(opts.items()))
    if knobs.get("autocast") and recipe.dtype != "float32":
        passes.pop("cast_dtype", None)
        changes["dtype_mode"] = "autocast"
        notes.append("autocast=True: low precision via autocast, weights stay fp32")
    return recipe.replace(passes=tuple(passes.values()), notes=tuple(notes), **changes)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_compile_options(opts) -> None:
    """Every key an inductor config option: a typo otherwise failed the compiled candidate
    and served eager, said only in the report (the new-user sweep, 2026-11-22)."""
    import difflib

    import torch._inductor.config as ic

    if not isinstance(opts, dict):
        raise TypeError(f"compile_options={opts!r} must be a dict of torch._inductor.config options, "
                        "e.g. {'max_autotune': True}")
    for key in opts:
        obj = ic
        for part in str(key).split("."):
            if not hasattr(obj, part):
                close = difflib.get_close_matches(str(key), list(ic.get_config_copy()), n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(f"compile_options key {key!r} is not a torch._inductor.config option{hint}")
            obj = getattr(obj, part)
