"""Read a Hugging Face decoder's structure into a DecoderSpec (data) and its parts (modules).

IPEX's LLM path kept a list of 32 architecture names and silently ran anything else
unoptimized. Here nothing is keyed on the architecture name: the decoder is read from
what it is made of.

- the layer stack: the ModuleList of ``config.num_hidden_layers`` identical blocks;
- around it: the token embedding (``get_input_embeddings``), an optional learned position
  embedding (a second Embedding beside it), the final norm (a norm beside the stack), the
  output head (``get_output_embeddings``), the rotary module (a module holding ``inv_freq``);
- in each block: two norms (pre-attention, pre-MLP), an attention module holding
  projections, and an MLP (gated with an activation, or plain).

Projection roles come from the projection vocabulary transformers uses across families
(q/k/v or one fused qkv in one of three layouts, gate/up or fused gate_up) and from shapes.
Whatever the reading gets wrong, the numeric check in api.py catches: the fast model is
compared with the model's own forward before it is used, and a mismatch falls back.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn


class Unsupported(Exception):
    """The fast path cannot run this model; the message says why (shown in the fallback warning)."""


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """What the fast decoder needs to know, as data (printable, JSON)."""
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    qkv_layout: str          # "split" (q,k,v modules), "concat" ([q;k;v] rows), "headwise" ([h,3,d] rows)
    qkv_transposed: bool     # Conv1D weights are [in, out]
    mlp: str                 # "gated" (act(gate)*up) or "plain" (act(fc_in))
    positions: str           # "rotary" or "learned"
    rotary_dim: int          # dims of each head that rotate (partial rotary: < head_dim); 0 without rotary
    rope_type: str
    position_offset: int     # learned positions: index = position + offset (OPT uses 2)
    parallel_residual: bool  # x + attn(ln1 x) + mlp(ln2 x) instead of two sequential residuals
    qk_norm: bool            # per-head norm of q and k before rotary
    scaling: tuple           # attention scale per layer
    max_positions: int
    sliding_window: int | None
    embed_scale: float | None = None  # what the forward multiplies embeddings by (read by running it)
    windowed: tuple | None = None     # per layer, whether sliding_window applies (None: every layer)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return json.dumps(self.to_dict())


@dataclasses.dataclass
class Block:
    """One decoder layer's modules (weights shared with the model's own)."""
    norm1: nn.Module
    norm2: nn.Module
    qkv: list          # modules in qkv order: [q, k, v] ("split") or [fused]
    out: nn.Module
    mlp_in: list       # [gate, up] / [gate_up] (gated) or [fc_in] (plain)
    mlp_out: nn.Module
    act: nn.Module
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None


@dataclasses.dataclass
class Parts:
    embed: nn.Module
    pos_embed: nn.Module | None
    blocks: list
    final_norm: nn.Module
    head: nn.Module
    inv_freq: torch.Tensor | None
    attention_scaling: float


# The projection vocabulary transformers uses across decoder families. Roles are names of
# *what a module computes*, shared by many architectures, not a list of architectures.
SPLIT_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
FUSED_QKV = {"qkv_proj": "concat", "c_attn": "concat", "Wqkv": "concat", "query_key_value": "headwise"}
GATED = (("gate_proj", "up_proj"), ("w1", "w3"))
FUSED_GATED = ("gate_up_proj",)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq does not depend on the sequence length


def _cfg(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _is_proj(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _is_norm(m: nn.Module, width: int) -> bool:
    w = getattr(m, "weight", None)
    return (not _is_proj(m) and not isinstance(m, nn.Embedding) and isinstance(w, torch.Tensor)
            and w.dim() == 1 and w.shape[0] == width and not list(m.children()))


def _act(m: nn.Module) -> nn.Module | None:
    """The activation module: a parameter-free leaf that is not dropout."""
    for c in m.children():
        if not list(c.parameters()) and not list(c.children()) and not isinstance(c, nn.Dropout):
            return c
    return None


def _stack(model: nn.Module, n_layers: int) -> tuple[nn.Module, str, nn.ModuleList]:
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n_layers and len({type(b) for b in m}) == 1:
            parent_name = name.rsplit(".", 1)[0] if "." in name else ""
            return model.get_submodule(parent_name), name, m
    raise Unsupported(f"no stack of {n_layers} identical decoder layers (config.num_hidden_layers) was found")


def _attention(block: nn.Module) -> tuple[nn.Module, dict]:
    for c in block.children():
        projs = {n: m for n, m in c.named_children() if _is_proj(m)}
        if any(n in FUSED_QKV for n in projs) or any(all(n in projs for n in s) for s in SPLIT_QKV):
            return c, projs
    raise Unsupported(f"{type(block).__name__} has no attention module with q/k/v projections")


class _Seen(Exception):
    """Stops a probe forward once the first layer's input is seen."""


def _windowed(config, n_layers: int, window) -> tuple[int | None, tuple | None]:
    """(the sliding window, which layers attend through it) from transformers' ``layer_types``: the window
    is None where no layer slides, the layers None where every layer does. Mixed types once went unread:
    every layer got the window, and Qwen2 with ``max_window_layers`` (full attention below it) decoded other
    tokens than HF's once the sequence passed the window, after a build check too short to see it (a
    new-user probe, fiftieth session)."""
    window = int(window) if window else None
    types = getattr(config, "layer_types", None)
    if types is None:
        if window is not None and getattr(config, "max_window_layers", None) is not None:
            # transformers without layer_types: which side of max_window_layers slides has changed with versions
            raise Unsupported("sliding window on some layers (max_window_layers) without layer_types to say which")
        return window, None
    types = list(types)
    kinds = set(types) - {"full_attention", "sliding_attention"}
    if kinds or len(types) != n_layers:
        raise Unsupported(f"layer_types {sorted(set(types))} over {len(types)} layers (fast path: "
                          f"'full_attention' and 'sliding_attention', one per layer of {n_layers})")
    layers = tuple(t == "sliding_attention" for t in types)
    if window is None or not any(layers):
        return None, None
    return window, None if all(layers) else layers


def _embedding_scale(model: nn.Module, embed: nn.Module, first: nn.Module, hidden: int) -> float | None:
    """The factor the model's forward puts on the embedding output before the first layer, read by
    running it on three tokens up to that layer; None when the layer sees the embedding as it is.
    Why a probe: transformers 4.x's Gemma scales by sqrt(hidden) inside GemmaModel.forward (5.x in
    its embedding module), and no config field says so; without it the fast decoder's logits were
    1.19 relative off and Gemma ran the stock path (torch 2.6 + transformers 4.57, sixteenth session)."""
    seen = {}

    def grab(mod, args, kwargs):
        seen["h"] = (args[0] if args else kwargs.get("hidden_states")).detach()
        raise _Seen

    ids = (torch.arange(1, 4) % embed.weight.shape[0])[None].to(embed.weight.device)
    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except _Seen:
        pass
    except Exception:  # noqa: BLE001 - no probe: the build's check against the forward still judges
        return None
    finally:
        handle.remove()
    with torch.no_grad():
        e = embed(ids).float()
    h = seen.get("h")
    if not isinstance(h, torch.Tensor) or h.shape != e.shape:
        return None
    h = h.float()
    if torch.allclose(h, e):
        return None
    c = float((h * e).sum() / (e * e).sum().clamp_min(1e-30))
    if not torch.allclose(h, e * c, rtol=1e-2, atol=1e-3 * float(h.abs().max())):
        return None  # not a plain scale: left to the check against the forward
    return hidden ** 0.5 if abs(c / hidden ** 0.5 - 1) < 1e-2 else c  # Gemma's sqrt(hidden), exactly


def read(model: nn.Module) -> tuple[DecoderSpec, Parts]:
    """The spec and parts of a decoder-only causal LM, or Unsupported with the reason."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise Unsupported(f"{type(model).__name__} is not a Hugging Face model (no config / output head)")
    if getattr(config, "is_encoder_decoder", False):
        raise Unsupported("encoder-decoder models are not decoders")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise Unsupported(f"{type(model).__name__} has no language-model head; tk.llm takes a "
                          "...ForCausalLM model")
    n_layers = _cfg(config, "num_hidden_layers", "n_layer")
    hidden = _cfg(config, "hidden_size", "n_embd")
    n_heads = _cfg(config, "num_attention_heads", "n_head")
    if not (n_layers and hidden and n_heads):
        raise Unsupported("config has no layer count / hidden size / head count")
    n_kv = _cfg(config, "num_key_value_heads", default=n_heads)
    head_dim = _cfg(config, "head_dim", default=hidden // n_heads)
    for flag in ("final_logit_softcapping", "attn_logit_softcapping"):
        if _cfg(config, flag):
            raise Unsupported(f"config.{flag} is set (logit soft-capping is not in the fast path)")
    if getattr(config, "multi_query", False):  # said plainly: the probe prompt failed in split_with_sizes on it
        raise Unsupported("multi-query attention in one fused projection (config.multi_query, GPTBigCode) is not in "
                          "the fast path")
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
        raise Unsupported("GPT-2 attention variants (scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn)")

    parent, stack_name, layers = _stack(model, n_layers)
    experts = next((n for n, m in layers[0].named_modules() if n.rsplit(".", 1)[-1] == "experts"), None)
    if experts is not None:  # said plainly: the MLP search below failed on it as "no activation module found"
        raise Unsupported(f"mixture-of-experts layers ({type(layers[0]).__name__}.{experts}: tokens routed to "
                          "experts) are not in the fast path")
    embed = model.get_input_embeddings()
    pos_embed = next((m for m in parent.children() if isinstance(m, nn.Embedding) and m is not embed), None)
    if pos_embed is None:  # OPT keeps the embeddings beside the stack, GPT-2 too; others may not
        pos_embed = next((m for n, m in model.named_modules() if isinstance(m, nn.Embedding) and m is not embed
                          and not n.startswith(stack_name)), None)
    if getattr(config, "do_layer_norm_before", True) is False:  # first: such a model has no final norm either
        raise Unsupported("post-norm layers (config.do_layer_norm_before=False) are not in the fast path")
    finals = [m for m in parent.children() if _is_norm(m, hidden)]
    if len(finals) != 1:
        raise Unsupported(f"expected one final norm beside the layer stack, found {len(finals)}")
    if any(_is_proj(m) for m in parent.children()):
        raise Unsupported("projections outside the layers (e.g. OPT project_in/out) are not in the fast path")
    rotary = next((m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)), None)

    blocks, scalings = [], []
    qkv_layout = mlp_kind = None
    transposed = qk_norm = False
    for blk in layers:
        attn, projs = _attention(blk)
        norms = [m for m in blk.children() if _is_norm(m, hidden)]
        if len(norms) != 2:
            raise Unsupported(f"{type(blk).__name__} has {len(norms)} norms at the hidden width (the fast path "
                              "knows pre-norm layers with two)")
        fused = next((n for n in projs if n in FUSED_QKV), None)
        if fused:
            qkv, layout = [projs[fused]], FUSED_QKV[fused]
        else:
            names = next(s for s in SPLIT_QKV if all(n in projs for n in s))
            qkv, layout = [projs[n] for n in names], "split"
        used = {id(m) for m in qkv}
        outs = [m for m in projs.values() if id(m) not in used]
        if len(outs) != 1:
            raise Unsupported(f"{type(attn).__name__}: expected one output projection, found {len(outs)}")
        transposed = type(qkv[0]).__name__ == "Conv1D"
        head_norms = [m for m in attn.children() if _is_norm(m, head_dim)]
        qk_norm = len(head_norms) == 2
        # the MLP: a child holding >= 2 projections, else the block itself (OPT keeps fc1/fc2 there)
        mlp = next((c for c in blk.children() if c is not attn and sum(_is_proj(x) for x in c.children()) >= 2), blk)
        mprojs = {n: m for n, m in mlp.named_children() if _is_proj(m)}
        act = _act(mlp) or _act(blk)
        if act is None:
            raise Unsupported(f"{type(mlp).__name__}: no activation module found")
        gated = next((s for s in GATED if all(n in mprojs for n in s)), None)
        fused_gate = next((n for n in FUSED_GATED if n in mprojs), None)
        if gated:
            mlp_in, kind = [mprojs[n] for n in gated], "gated"
        elif fused_gate:
            mlp_in, kind = [mprojs[fused_gate]], "gated"
        elif len(mprojs) == 2:
            mlp_in, kind = [next(iter(mprojs.values()))], "plain"
        else:
            raise Unsupported(f"{type(mlp).__name__}: MLP projections {sorted(mprojs)} not understood")
        rest = [m for m in mprojs.values() if all(m is not x for x in mlp_in)]
        if len(rest) != 1:
            raise Unsupported(f"{type(mlp).__name__}: expected one down projection")
        if (qkv_layout, mlp_kind) not in ((None, None), (layout, kind)):
            raise Unsupported("layers differ in structure")
        qkv_layout, mlp_kind = layout, kind
        scalings.append(float(getattr(attn, "scaling", head_dim ** -0.5)))
        blocks.append(Block(norms[0], norms[1], qkv, outs[0], mlp_in, rest[0], act,
                            head_norms[0] if qk_norm else None, head_norms[1] if qk_norm else None))

    if rotary is not None:
        rope_type = str(getattr(rotary, "rope_type", "default"))
        if rope_type not in STATIC_ROPE:
            raise Unsupported(f"rope_type={rope_type!r} changes with sequence length (fast path: {STATIC_ROPE})")
        positions, rotary_dim = "rotary", 2 * rotary.inv_freq.numel()
    elif pos_embed is not None:
        positions, rotary_dim, rope_type = "learned", 0, "none"
    else:
        raise Unsupported("no rotary module (inv_freq) and no learned position embedding found")
    window = _cfg(config, "sliding_window")
    if window is not None and getattr(config, "use_sliding_window", True) is False:
        window = None
    window, windowed = _windowed(config, n_layers, window)
    spec = DecoderSpec(
        n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        vocab=head.out_features, qkv_layout=qkv_layout, qkv_transposed=transposed, mlp=mlp_kind,
        positions=positions, rotary_dim=rotary_dim, rope_type=rope_type,
        position_offset=int(getattr(pos_embed, "offset", 0)) if positions == "learned" else 0,
        parallel_residual=bool(getattr(config, "use_parallel_residual", False)), qk_norm=qk_norm,
        scaling=tuple(scalings), max_positions=int(_cfg(config, "max_position_embeddings", "n_positions",
                                                        default=2048)),
        sliding_window=window,
        embed_scale=_embedding_scale(model, embed, layers[0], hidden) if positions == "rotary" else None,
        windowed=windowed)
    parts = Parts(embed, pos_embed if positions == "learned" else None, blocks, finals[0], head,
                  rotary.inv_freq if rotary is not None else None,
                  float(getattr(rotary, "attention_scaling", 1.0)) if rotary is not None else 1.0)
    return spec, parts
