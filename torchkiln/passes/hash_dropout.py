"""Dropout masks from a counter hash in compiled CPU training steps.

Hand-written because inductor's CPU dropout is slow: it draws each element's number
with its own Philox4x32-10 evaluation (``normalized_rand_cpu``), a scalar call per
element, 13-16 ns per element on 2 Zen 4 cores (fwd+bwd). bert-base bs8 seq128 draws
~39 M of them per step, and the stock compiled step ran 3.43 s with dropout against
2.78 s with every dropout probability set to 0 (benchmarks/RESULTS.md, tenth session).

Here the mask is a pure function of the element's index and a per-call 64-bit seed:
two rounds of the lowbias32 integer hash (C. Wellons' hash-prospector; bias 0.17),
in int32 tensor ops that inductor vectorises and fuses into the neighbouring kernels,
3.6-4.2 ns per element fwd+bwd. Because the mask is recomputable from the seed, the
backward either recomputes it or reads the saved one: both are the forward's mask.

The seed is drawn from torch's generator once per call (``torch.randint``), so
``torch.manual_seed`` makes runs repeatable and every call draws new masks. The
stream differs from eager's, as inductor's own already does; tests check its
statistics (tests/passes/test_hash_dropout.py). Rewritten, in the graph dynamo
captures (inductor's pre-grad pass): ``F.dropout(x, p, training=True)`` and
``F.scaled_dot_product_attention(..., dropout_p=p)``, the latter as the math form
(two batched GEMMs and a softmax, what inductor decomposes SDPA with dropout into on
the CPU anyway) with the hashed mask on the probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .fxargs import traced
from .registry import GraphPass, register_graph_only
from .sdpa_math import SDPA, bind_sdpa, math_attention

_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers, as int32
_BITS = 24  # the hash bits compared with the drop probability


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 (wrapping multiplies; torch's >> is arithmetic, so the masks make it logical)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _M1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _M2
    return x ^ ((x >> 16) & 0xFFFF)


def keep_mask(shape, p: float, seed: torch.Tensor, device) -> torch.Tensor:
    """True where an element is kept (probability 1 - p). ``seed``: two int32 words."""
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n, dtype=torch.int32, device=device).view(shape)
    h = _mix(_mix(idx ^ seed[0]) + seed[1])
    return ((h >> (32 - _BITS)) & ((1 << _BITS) - 1)) >= int(round(p * (1 << _BITS)))


def hash_dropout(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    if x.numel() >= 2**31:  # the int32 counter would wrap: torch's own dropout
        return F.dropout(x, p, True)
    keep = keep_mask(x.shape, p, seed, x.device)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


def attention_dropout(q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool,
                      seed: torch.Tensor) -> torch.Tensor:
    return math_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa,
                          dropout=lambda probs: hash_dropout(probs, dropout_p, seed))


def new_seeds(n: int, device) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (n, 2), dtype=torch.int32, device=device)


_DROPOUT_ARGS = ("input", "p", "training", "inplace")


def _dropout_site(node) -> dict | None:
    if node.op != "call_function" or node.target is not F.dropout:
        return None
    if len(node.args) > 4 or set(node.kwargs) - set(_DROPOUT_ARGS):
        return None
    b = {"p": 0.5, "training": True, "inplace": False, **dict(zip(_DROPOUT_ARGS, node.args, strict=False)),
         **node.kwargs}
    if "input" not in b or b["training"] is not True or b["inplace"] is not False:
        return None
    p = b["p"]
    return b if isinstance(p, float) and 0.0 < p < 1.0 else None


def _attention_site(node) -> dict | None:
    if node.op != "call_function" or node.target not in SDPA:
        return None
    b = bind_sdpa(node.args, node.kwargs)
    if len(node.args) > 8 or "query" not in b or "key" not in b or "value" not in b:
        return None
    p = b["dropout_p"]
    ok = isinstance(p, float) and 0.0 < p < 1.0 and isinstance(b["is_causal"], bool) \
        and isinstance(b["enable_gqa"], bool) and not isinstance(b["scale"], torch.fx.Node)
    return b if ok else None


def _device(node) -> torch.device | None:
    val = traced(node)
    return val.device if val is not None else None


def rewrite(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cpu",), attention: bool = True) -> int:
    """Rewrites the graph's training-mode dropouts on ``devices`` (device types); returns how many.
    ``attention=False`` leaves SDPA alone (on CUDA its flash kernels drop inside the kernel)."""
    sites = []
    for node in graph.nodes:
        b = _dropout_site(node)
        kind = "dropout"
        if b is None and attention:
            b, kind = _attention_site(node), "attention"
        if b is None:
            continue
        dev = _device(b["input"] if kind == "dropout" else b["query"])
        if dev is None or dev.type not in devices:  # the planner asks for CPUs only (measured there)
            continue
        sites.append((node, kind))
        device = dev
    if not sites:
        return 0
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        seeds = graph.call_function(new_seeds, (len(sites), device))
    for i, (node, kind) in enumerate(sites):
        # bound again: an earlier rewrite may have replaced this node's input (dropout after attention)
        b = _dropout_site(node) if kind == "dropout" else _attention_site(node)
        with graph.inserting_before(node):
            seed = graph.call_function(torch.select, (seeds, 0, i))
            if kind == "dropout":
                new = graph.call_function(hash_dropout, (b["input"], b["p"], seed))
            else:
                new = graph.call_function(attention_dropout, (
                    b["query"], b["key"], b["value"], b["attn_mask"], b["dropout_p"], b["is_causal"], b["scale"],
                    b["enable_gqa"], seed))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    return len(sites)


class HashDropoutPass(GraphPass):
    """The inductor pre-grad hook; ``rewritten`` counts rewrites over the compiles it served, ``graphs`` the
    graphs it saw (none: every graph came from inductor's cache)."""

    source = __file__

    def __init__(self, devices: tuple[str, ...] = ("cpu",), attention: bool = True):
        self.rewritten, self.graphs, self.devices, self.attention = 0, 0, devices, attention

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        self.rewritten += rewrite(graph, self.devices, self.attention)

    def options(self) -> tuple:
        return self.devices, self.attention


@dataclass(frozen=True)
class HashDropoutConfig:
    name: ClassVar[str] = "hash_dropout"


register_graph_only(HashDropoutConfig, 95, "in the compiled training step", lambda config: HashDropoutPass())
