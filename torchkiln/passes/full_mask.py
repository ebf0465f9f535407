"""Drop an attention mask that masks nothing from SDPA calls in a compiled graph.

Why hand-written: transformers up to 5.17 (the H200 image's) builds BERT's bidirectional mask
while being traced even when the call has no ``attention_mask`` (eager skips it:
``_ignore_bidirectional_mask_sdpa`` answers False under ``is_tracing``), an all-True
(batch, 1, seq, seq) mask made from ``arange``. Given any mask, SDPA inside the compiled step
leaves cuDNN's and flash's kernels (eager ran cuDNN's there): bert-large bs16 seq512 on the
H200 ran its attention as a math decomposition in float32 GEMMs (the stock compiled step,
77 ms, and torchkiln's, 92 ms, both; benchmarks/RESULTS.md, fifty-first session). Newer
transformers skip the mask themselves; torch has no pass that does.

A mask is dropped only when its whole computation is in the graph with no input (no
placeholder: no data, no symbolic size, no parameter or buffer) and no random or
uninitialised op, when evaluated once at compile time every element attends (True, or 0.0
for an additive mask), and when it broadcasts to the scores' shape without widening it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.fx.node import map_arg

from .fxargs import traced
from .registry import CountingPass, register_graph_only
from .sdpa_math import SDPA, bind_sdpa

try:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
except ImportError:  # pragma: no cover (every supported torch has it)
    unset_fake_temporarily = contextlib.nullcontext

# substrings of op names whose result is not a function of their arguments
_UNSTABLE = ("rand", "normal", "bernoulli", "multinomial", "uniform", "empty", "dropout", "poisson", "exponential",
             "geometric", "cauchy", "seed")
_MAX_ELEMENTS = 1 << 26  # larger masks are not evaluated at compile time


def _ancestors(mask: torch.fx.Node) -> set | None:
    """Every node the mask is computed from, or None if any of them is an input or unstable."""
    seen, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if n.op not in ("call_function", "call_method") or any(u in str(name).lower() for u in _UNSTABLE):
            return None
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _evaluate(graph: torch.fx.Graph, mask: torch.fx.Node, nodes: set):
    vals: dict = {}
    with unset_fake_temporarily(), torch.no_grad():
        for n in graph.nodes:
            if n not in nodes:
                continue
            args, kwargs = map_arg((n.args, n.kwargs), lambda a: vals[a])
            vals[n] = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" \
                else n.target(*args, **kwargs)
            if n is mask:
                return vals[n]
    return None


def _attends_everywhere(m, q, k) -> bool:
    if not isinstance(m, torch.Tensor) or m.numel() > _MAX_ELEMENTS:
        return False
    scores = (*q.shape[:-1], k.shape[-2])
    try:
        if torch.broadcast_shapes(m.shape, scores) != torch.Size(scores):
            return False
    except RuntimeError:
        return False
    return bool(m.all()) if m.dtype == torch.bool else bool((m == 0).all())


def rewrite(graph: torch.fx.Graph) -> int:
    """Drops constant all-attend masks from the graph's SDPA calls; returns how many."""
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA or len(node.args) > 8:
            continue
        b = bind_sdpa(node.args, node.kwargs)
        mask, q, k = b.get("attn_mask"), traced(b.get("query")), traced(b.get("key"))
        if not isinstance(mask, torch.fx.Node) or q is None or k is None or b.get("is_causal") is not False:
            continue
        shown = traced(mask)  # what tracing saw: a mask too large to evaluate at compile time is left alone
        if shown is not None and shown.numel() > _MAX_ELEMENTS:
            continue
        nodes = _ancestors(mask)
        if nodes is None or len(nodes) > 64:
            continue
        try:
            value = _evaluate(graph, mask, nodes)
        except Exception:  # noqa: BLE001 - a mask this cannot compute stays as it is
            continue
        if not _attends_everywhere(value, q, k):
            continue
        if len(node.args) > 3 and node.args[3] is mask:
            node.update_arg(3, None)
        else:
            node.update_kwarg("attn_mask", None)
        for n in reversed(list(graph.nodes)):  # the mask's computation, where nothing else uses it
            if n in nodes and not n.users:
                graph.erase_node(n)
        dropped += 1
    return dropped


class FullMaskPass(CountingPass):
    source = __file__
    rewrite = staticmethod(rewrite)


@dataclass(frozen=True)
class FullMaskConfig:
    name: ClassVar[str] = "full_mask"


register_graph_only(FullMaskConfig, 90, "in the compiled training step", lambda config: FullMaskPass())
