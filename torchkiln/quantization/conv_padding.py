"""Convolutions written with a padding *string* ("same" / "valid", as transformers' EfficientNet and
other Keras-ported models write them) restated with the same numbers, in an exported graph, before
the pt2e quantizer sees it.

Why: export records them as ``aten.conv2d.padding``, and torchao's X86InductorQuantizer matches only
``aten.conv2d.default``: it refused the whole model ("conv2d is not an aten conv2d operator"), so
int8 failed for stock pt2e and torchkiln alike (RESULTS.md, "Forty-eighth session"). Only symmetric
cases are restated ("valid"; "same" where dilation * (kernel - 1) is even in both dimensions, which a
stride-1 odd kernel always is); an even kernel's "same" pads one side more and stays as it is.
"""

from __future__ import annotations

import torch

from ..passes.fxargs import call_args, pair

aten = torch.ops.aten


def numeric_conv_padding(graph: torch.fx.GraphModule) -> int:
    """``graph`` changed in place; returns how many convolutions were restated."""
    done = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target is not aten.conv2d.padding:
            continue
        a = call_args(node)
        weight = a["weight"].meta.get("val") if isinstance(a["weight"], torch.fx.Node) else None
        if weight is None or weight.dim() != 4:
            continue
        stride, dilation = list(pair(a["stride"])), list(pair(a["dilation"]))
        if a["padding"] == "valid":
            pad = [0, 0]
        elif a["padding"] == "same" and stride == [1, 1]:
            total = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:], strict=True)]
            if any(t % 2 for t in total):
                continue  # "same" with an even kernel: one side gets more, no symmetric number says it
            pad = [t // 2 for t in total]
        else:
            continue
        with graph.graph.inserting_before(node):
            new = graph.graph.call_function(aten.conv2d.default, (a["input"], a["weight"], a["bias"], stride, pad,
                                                                 dilation, a["groups"]))
        new.meta = dict(node.meta)  # source_fn_stack and val: what the quantizer's matching reads
        node.replace_all_uses_with(new)
        graph.graph.erase_node(node)
        done += 1
    if done:
        graph.graph.lint()
        graph.recompile()
    return done
