"""The pt2e flow (torch.export -> prepare_pt2e with X86InductorQuantizer -> calibrate ->
convert_pt2e), used on CPU for int8-static, int8-smoothquant and int8-dynamic.

torchao owns the flow; torchkiln adds: export with every input dimension left dynamic where
the model allows (a model calibrated at batch 8 still takes batch 1), sibling linears (Q, K, V)
merged into one (concat_linear_fx.py), modules kept in floating point by name, and the
observers' state as JSON (calibration saved without pickle).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .. import inputs
from ..modelutil import first_line
from .concat_linear_fx import concat_sibling_linears
from .config import QuantConfig
from .conv_padding import numeric_conv_padding
from .schemes import _quiet_torchao


def _pt2e():
    with _quiet_torchao():
        try:
            import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        except ModuleNotFoundError as e:
            # torchao 0.10 (installable with torch 2.6) has no pt2e yet. torch.ao's own copy of the flow
            # was tried there: its int8 graphs came out unquantized (SQNR 152 dB against float) and served
            # eagerly, so a clear error instead of a model that only claims int8 (sixteenth session).
            import torchao

            raise ImportError(f"int8 quantization through pt2e needs torchao's pt2e flow, which torchao "
                              f"{torchao.__version__} does not have ({e}); pip install a newer torchao built for "
                              f"torch {torch.__version__}, or use scheme='int8-weight-only'") from e
    return xiq, prepare_pt2e, convert_pt2e


def missing() -> str | None:
    """Why the pt2e flow cannot run with this torchao (the ImportError's message), or None if it can."""
    try:
        _pt2e()
    except ImportError as e:
        return str(e)
    return None


def export(model: nn.Module, sample: inputs.Args) -> tuple[nn.Module, bool]:
    """(graph module, dynamic): every tensor dimension dynamic if export allows, else static.

    Strict export (dynamo) first: it records each node's ``source_fn_stack``, which torchao's
    annotator matches patterns on. Non-strict export does not record it; torch 2.13 falls back
    to the module stack, but torch 2.11 (measured on the H200 image, torchao 0.18) matches nothing
    there, so every layer stayed float, silently. Non-strict when dynamo cannot trace the model.
    """
    args, kwargs = sample
    auto = torch.export.Dim.AUTO

    def spec(v):
        return {d: auto for d in range(v.dim())} if isinstance(v, torch.Tensor) else None

    dyn = (tuple(spec(a) for a in args) if not kwargs
           else {**_arg_names(model, args), **{k: spec(v) for k, v in kwargs.items()}})
    wide = _widened(sample)
    for a, k in ([wide] if wide is not None else []) + [sample]:
        for strict in (True, False):
            try:
                ep = torch.export.export(model, a, k, strict=strict, dynamic_shapes=dyn)
                return ep.module(), True
            except Exception:  # the next way; last, calibrated shapes only
                continue
    return torch.export.export(model, args, kwargs, strict=False).module(), False


def _widened(sample: inputs.Args) -> inputs.Args | None:
    """A batch-1 sample repeated to batch 2, or None if it is not one batch-1 sample. Export
    specializes every size-1 dimension, so a model exported from a batch-1 sample accepted batch 1
    only (zoo resnet50: "Guard failed: x.size()[0] == 1" at batch 2); traced at batch 2 the batch
    stays symbolic, and the graph still runs batch 1."""
    tensors = [t for t in inputs.flatten(sample) if t.dim() >= 1]
    if not tensors or any(t.shape[0] != 1 for t in tensors):
        return None
    return inputs.tree_map(lambda t: torch.cat([t, t]) if t.dim() >= 1 else t, sample)


def _arg_names(model: nn.Module, args: tuple) -> dict:
    import inspect

    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    auto = torch.export.Dim.AUTO
    return {p.name: ({d: auto for d in range(a.dim())} if isinstance(a, torch.Tensor) else None)
            for p, a in zip(params, args, strict=False)}


def split_repeated_calls(graph: torch.fx.GraphModule) -> dict[str, list[str]]:
    """Name each call of a module used more than once apart: {module name: [the call names]}.

    Hand-written because torch's ``get_source_partitions`` lacks it. Without ``source_fn_stack``
    (non-strict export does not write it) it groups nodes by their innermost module name, so a
    module called three times (a ResNet bottleneck's one ``self.relu``, as in torchvision) becomes
    one partition with three outputs, and torchao's X86InductorQuantizer raises "Input partition
    has more than one output node" on the whole model. Export already tells the calls apart in
    the ``nn_module_stack`` key (``L__self__relu@1``); we carry that suffix into the name.
    """
    calls: dict[str, list[str]] = {}
    for node in graph.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack:
            continue
        key, (fqn, cls) = list(stack.items())[-1]
        if "@" in key and "@" not in fqn:
            name = fqn + key[key.rindex("@"):]
            node.meta["nn_module_stack"] = {**stack, key: (name, cls)}  # the dicts can be shared
            calls.setdefault(fqn, [])
            if name not in calls[fqn]:
                calls[fqn].append(name)
    return calls


def quantizer(config: QuantConfig, calls: dict[str, list[str]] | None = None):
    xiq, _, _ = _pt2e()
    q = xiq.X86InductorQuantizer()
    q.set_global(xiq.get_default_x86_inductor_quantization_config(is_dynamic=config.scheme == "int8-dynamic"))
    for name in config.keep:  # a kept module stays float at each of its calls
        for call in (name, *(calls or {}).get(name, ())):
            q.set_module_name_qconfig(call, None)
    return q


def prepare(model: nn.Module, config: QuantConfig, sample: inputs.Args,
            merge_linears: bool = True) -> tuple[nn.Module, bool]:
    """``merge_linears=False``: as before the merge existed (files saved then hold one observer per linear)."""
    _, prepare_pt2e, _ = _pt2e()
    graph, dynamic = export(model, sample)
    numeric_conv_padding(graph)
    if merge_linears:
        concat_sibling_linears(graph, config.keep)
    calls = split_repeated_calls(graph)
    try:
        return prepare_pt2e(graph, quantizer(config, calls)), dynamic
    except ValueError as e:  # torchao's annotator rejects some graphs
        raise ValueError(f"scheme={config.scheme!r}: torchao's X86InductorQuantizer could not annotate this model "
                         f"({first_line(e)}); scheme='int8-weight-only' does not need it") from e


def convert(prepared: nn.Module) -> nn.Module:
    _, _, convert_pt2e = _pt2e()
    out = convert_pt2e(prepared)
    # torchao carries it now; torch.ao's (older torch) went away. Exported graphs keep the
    # train/eval behaviour of export time; this switches dropout and batch norm to eval.
    try:
        from torchao.quantization.pt2e import move_exported_model_to_eval as move
    except ImportError:
        move = getattr(torch.ao.quantization, "move_exported_model_to_eval", None)
    out = move(out) if move is not None else out
    return functional_sdpa(out)


def functional_sdpa(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Call attention as ``F.scaled_dot_product_attention`` (export records the aten op), so the
    attention router (passes/sdpa_math.py), which intercepts the functional call, can choose its
    form inside the quantized graph too. The same op runs when no router is entered."""
    nodes = [n for n in graph.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    for n in nodes:
        n.target = torch.nn.functional.scaled_dot_product_attention
    if nodes:
        graph.recompile()
    return graph


def observer_state(prepared: nn.Module) -> dict:
    """Every observer's buffers (min/max, histogram) as JSON-ready lists."""
    state = {}
    for name, mod in prepared.named_modules():
        if name.startswith("activation_post_process"):
            state[name] = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                               "values": v.flatten().tolist()} for k, v in mod.state_dict().items()}
    return state


def load_observer_state(prepared: nn.Module, state: dict) -> None:
    mods = {n: m for n, m in prepared.named_modules() if n.startswith("activation_post_process")}
    if set(mods) != set(state):
        raise ValueError(f"the calibration has {len(state)} observers, the prepared model {len(mods)}: it was "
                         "calibrated for another model or configuration")
    for name, mod in mods.items():
        sd = OrderedDict((k, torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"]))
                         for k, v in state[name].items())
        # Without a version, the observers read the state as version 1 (before eps was a buffer) and
        # reset eps to float32's: the x86 quantizer's 2**-12 was lost, and a weight channel whose
        # range is below 127.5 * 2**-12 then rounded differently after load (SmoothQuant alpha="auto"
        # reloaded 5e-4 off the model it saved).
        sd._metadata = {"": {"version": getattr(type(mod), "_version", None)}}
        for k, v in sd.items():  # histogram observers size their buffers at the first batch
            cur = getattr(mod, k, None)
            if isinstance(cur, torch.Tensor) and cur.shape != v.shape:
                setattr(mod, k, torch.empty_like(v))
        mod.load_state_dict(sd)
