"""Sibling linears in an exported graph (Q, K and V: one input, several weights) as one linear
whose output is sliced, before the pt2e quantizer annotates the graph.

Why: the int8 linear inductor calls (``onednn::qlinear_pointwise``) builds its oneDNN primitive
at every call, ~20 us on a 2-core Zen 4; one wide GEMM also uses the cores better than three
narrow ones. bert-base's shapes there (128x768 by 3x768 against 2304): 306 against 260 us
per layer (benchmarks/diag_opaque_softmax.py --part qkv; RESULTS.md). Nothing in torch or
torchao does this for the pt2e graph: inductor's own concat pass (``cpp.enable_concat_linear``)
matches float ``mm`` nodes after freezing, not int8 ones.

Exact: the siblings share their input's observer already (one scale, one zero point), and
weights are quantized per output channel, so the concatenated weight quantizes row for row as
the separate ones did; int32 accumulation has no order to change. The layers stay named: the
fused linear carries the first sibling's module stack, and a linear kept in floating point
(``QuantConfig.keep``: the user's, or auto_fallback's) is never merged, so the quantizer still
finds it by its name.
"""

from __future__ import annotations

import functools

import torch
from torch import fx

LINEAR = torch.ops.aten.linear.default


def _attr(gm: fx.GraphModule, node) -> torch.Tensor | None:
    if node is None:
        return None
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        raise LookupError
    return functools.reduce(getattr, node.target.split("."), gm)


def module_name(node: fx.Node) -> str:
    """The innermost module a node was traced in ('' if none)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


Sibling = tuple[fx.Node, torch.Tensor, torch.Tensor | None]  # a linear node, its weight, its bias


def _groups(gm: fx.GraphModule, keep: tuple[str, ...]) -> list[list[Sibling]]:
    by_input: dict[fx.Node, list[Sibling]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not LINEAR or len(n.args) < 2 or n.kwargs:
            continue
        try:
            w, b = _attr(gm, n.args[1]), _attr(gm, n.args[2] if len(n.args) > 2 else None)
        except (LookupError, AttributeError):
            continue  # a weight computed in the graph: not a constant to concatenate
        if w is None or w.dim() != 2 or any(module_name(n).startswith(k) for k in keep if k):
            continue
        by_input.setdefault(n.args[0], []).append((n, w, b))
    groups = []
    for sibs in by_input.values():
        _, w0, b0 = sibs[0]
        same = [(n, w, b) for n, w, b in sibs if w.shape[1] == w0.shape[1] and w.dtype == w0.dtype
                and (b is None) == (b0 is None)]
        if len(same) > 1:
            groups.append(same)
    return groups


def _fake(like, fn):
    """A fake value for a new node, made in the fake mode of a neighbour's; None without one."""
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return fn(like)


def concat_sibling_linears(gm: fx.GraphModule, keep: tuple[str, ...] = ()) -> int:
    """Rewrite ``gm`` in place; returns how many linears were merged away."""
    merged = 0
    for i, group in enumerate(_groups(gm, keep)):
        nodes, ws, bs = zip(*group, strict=True)
        name = f"_kiln_concat_linear_{i}"
        while hasattr(gm, name + "_weight"):
            name += "_"
        gm.register_buffer(name + "_weight", torch.cat([w.detach() for w in ws]))
        if bs[0] is not None:
            gm.register_buffer(name + "_bias", torch.cat([b.detach() for b in bs]))
        first = nodes[0]  # graph order: every sibling comes after the shared input
        with gm.graph.inserting_before(first):
            w_node = gm.graph.get_attr(name + "_weight")
            b_node = gm.graph.get_attr(name + "_bias") if bs[0] is not None else None
            fused = gm.graph.call_function(LINEAR, (first.args[0], w_node, *([b_node] if b_node else [])))
        fused.meta.update({k: v for k, v in first.meta.items() if k != "val"})
        total = sum(w.shape[0] for w in ws)
        val = first.meta.get("val")
        fake = _fake(val, lambda v, n=total: v.new_empty((*v.shape[:-1], n)))
        if fake is not None:
            fused.meta["val"] = fake
        start = 0
        for n, w in zip(nodes, ws, strict=True):
            end = start + w.shape[0]
            with gm.graph.inserting_after(fused):
                piece = gm.graph.call_function(torch.ops.aten.slice.Tensor, (fused, -1, start, end))
            piece.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "source_fn_stack")})
            stack = n.meta.get("nn_module_stack")
            if stack:  # the slice belongs to the linear's parent: the quantizer groups nodes by module
                piece.meta["nn_module_stack"] = dict(list(stack.items())[:-1])
            if fake is not None:
                piece.meta["val"] = _fake(fake, lambda v, s=start, e=end: v[..., s:e])
            n.replace_all_uses_with(piece)
            gm.graph.erase_node(n)
            start = end
        merged += len(nodes) - 1
    if merged:
        gm.graph.eliminate_dead_code()
        # The siblings' own weights are read by nothing now: drop them (the caller's model keeps its own).
        used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        for target in [t for t, _ in gm.named_parameters()] + [t for t, _ in gm.named_buffers()]:
            if target not in used:
                owner, _, leaf = target.rpartition(".")
                delattr(gm.get_submodule(owner) if owner else gm, leaf)
        gm.recompile()
    return merged
