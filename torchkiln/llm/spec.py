"""Read a Hugging Face decoder's structure into a DecoderSpec (data) and its parts (modules).

IPEX's LLM path kept a list of 32 architecture names and silently ran anything else
unoptimized. Here nothing is keyed on the architecture name: the decoder is read from
what it is made of.

- the layer stack: the ModuleList of ``config.num_hidden_layers`` identical blocks;
- around it: the token embedding (``get_input_embeddings``), an optional learned position
  embedding (a second Embedding beside it), the final norm (a norm beside the stack), the
  output head (``get_output_embeddings``), the rotary module (a module holding ``inv_freq``);
- in each block: two norms (pre-attention, pre-MLP), or four (Gemma 2/3's "sandwich": each of
  attention and MLP also normed on its way out), an attention module holding projections, and an
  MLP (gated with an activation, or plain).

Projection roles come from the projection vocabulary transformers uses across families
(q/k/v or one fused qkv in one of three layouts, gate/up or fused gate_up) and from shapes.
Whatever the reading gets wrong, the numeric check in api.py catches: the fast model is
compared with the model's own forward before it is used, and a mismatch falls back.
"""

from __future__ import annotations

import copy
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
    sandwich: bool = False            # four norms a layer: x + post1(attn(norm1 x)), then the same for the MLP
    attn_softcap: float | None = None   # scores = cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    local_rope: tuple | None = None   # per layer, whether it rotates by the second (local) table (Gemma 3)
    long_after: int | None = None     # longrope: a forward reaching this position rotates by the long table
    rope_pairs: str = "halves"        # rotary pairs (i, i + d/2), or "interleaved" (2i, 2i + 1: GLM, Helium, Cohere)
    rotary_layers: tuple | None = None  # per layer, whether it rotates at all (None: every layer; SmolLM3's NoPE)
    residual_scale: float | None = None  # x + part(x) * scale (Granite's residual_multiplier)
    logit_scale: float | None = None     # logits * scale (Cohere's logit_scale)
    logit_divisor: float | None = None   # logits / divisor (Granite's logits_scaling)
    qk_norm_width: str = "head"          # q/k norms per head, or "full": over all heads at once (OLMo 2)
    norm_place: str = "pre"              # two-norm layers: "pre" (before attention / MLP) or "post" (on their
                                         # outputs, before the residual add: OLMo 2), as the float32 check finds

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
    post1: nn.Module | None = None  # sandwich layers: the attention output's norm
    post2: nn.Module | None = None  # and the MLP output's


@dataclasses.dataclass
class Parts:
    embed: nn.Module
    pos_embed: nn.Module | None
    blocks: list
    final_norm: nn.Module
    head: nn.Module
    inv_freq: torch.Tensor | None
    attention_scaling: float
    local_inv_freq: torch.Tensor | None = None  # the layers spec.local_rope marks rotate by this one
    local_scaling: float = 1.0
    long_inv_freq: torch.Tensor | None = None   # longrope's table past spec.long_after


# The projection vocabulary transformers uses across decoder families. Roles are names of
# *what a module computes*, shared by many architectures, not a list of architectures.
SPLIT_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
FUSED_QKV = {"qkv_proj": "concat", "c_attn": "concat", "Wqkv": "concat", "query_key_value": "headwise"}
GATED = (("gate_proj", "up_proj"), ("w1", "w3"))
FUSED_GATED = ("gate_up_proj",)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq does not depend on the sequence length
# inv_freq depends on the sequence length, read as transformers' rotary changes it (_length_rope):
# "longrope" between two tables at a threshold; "dynamic" grows past max_position_embeddings, where a
# call goes to the model's own generate (runner.reserve)
LENGTH_ROPE = ("longrope", "dynamic")


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


@dataclasses.dataclass
class Rope:
    kind: str
    inv_freq: torch.Tensor
    scaling: float
    local_inv_freq: torch.Tensor | None = None
    local_scaling: float = 1.0
    local: tuple | None = None  # per layer: rotates by the local table
    long_inv_freq: torch.Tensor | None = None
    long_after: int | None = None


def _rope_kind(module: nn.Module, layer_type: str | None = None, length: bool = False) -> str:
    kind = getattr(module, "rope_type", "default")
    kind = str(kind.get(layer_type, "default") if isinstance(kind, dict) else kind)
    if kind not in STATIC_ROPE + (LENGTH_ROPE if length else ()):
        raise Unsupported(f"rope_type={kind!r} changes with sequence length (fast path: "
                          f"{STATIC_ROPE + (LENGTH_ROPE if length else ())})")
    return kind


def _table_at(rotary: nn.Module, position: int) -> torch.Tensor:
    """The inv_freq a copy of ``rotary`` computes with for a forward reaching ``position`` (its
    ``dynamic_rope_update`` picks the table from the largest position id, then rotates)."""
    probe = copy.deepcopy(rotary)
    x = torch.zeros(1, 1, 1, device=probe.inv_freq.device)
    with torch.no_grad():
        probe(x, torch.tensor([[position]], device=x.device))
    return probe.inv_freq.detach().clone()


def _length_rope(config, rotary: nn.Module, rope: Rope) -> Rope:
    """Tables for a rope whose inv_freq depends on the sequence length, read by running a copy of the
    model's rotary module, so the choice is transformers' own in every version (4.x reads the threshold
    from config.original_max_position_embeddings, 5.x from rope_parameters). Phi-3.5 / Phi-4-mini's
    "longrope": the short table up to original_max_position_embeddings, the long one for a forward that
    reaches past it (the whole forward: the prompt's prefill, or every decode step from there on).
    "dynamic" (NTK): the model's own table up to max_position_embeddings; past it, the model's generate."""
    original = getattr(rotary, "original_inv_freq", rotary.inv_freq).detach().clone()
    if rope.kind == "dynamic":
        return dataclasses.replace(rope, inv_freq=original)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    after = (params.get("original_max_position_embeddings") if isinstance(params, dict) else None) \
        or getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
    try:
        short, long = _table_at(rotary, after - 1), _table_at(rotary, after)
    except Exception as e:  # noqa: BLE001 - a rotary module of another shape: said, and the stock path serves
        raise Unsupported(f"longrope tables could not be read by running the rotary module ({e})") from e
    if not torch.equal(short, original) or torch.equal(long, original):
        raise Unsupported(f"longrope: the rotary module does not switch tables at position {after} "
                          "(original_max_position_embeddings) as read from the config")
    return dataclasses.replace(rope, inv_freq=original, long_inv_freq=long, long_after=int(after))


def _rotary(model: nn.Module, config, layer_types) -> Rope | None:
    """The rotary tables, as transformers keeps them: one module's ``inv_freq``; or, where layer types
    rotate differently (Gemma 3: local layers at base 10k, global ones at 1M), one table per type
    (transformers 5: ``sliding_attention_inv_freq`` beside ``full_attention_inv_freq`` in one module;
    4.x: a second module, ``rotary_emb_local``). None: no rotary module."""
    types = list(layer_types or [])
    for m in model.modules():
        tables = {t: getattr(m, f"{t}_inv_freq", None) for t in set(types)}
        if not tables or not all(isinstance(v, torch.Tensor) for v in tables.values()):
            continue
        if set(tables) - {"full_attention", "sliding_attention"}:
            raise Unsupported(f"rotary tables per layer type {sorted(tables)} (fast path: 'full_attention', "
                              "'sliding_attention')")
        main = "full_attention" if "full_attention" in tables else "sliding_attention"
        scale = {t: float(getattr(m, f"{t}_attention_scaling", 1.0)) for t in tables}
        rope = Rope(_rope_kind(m, main), tables[main], scale[main])
        if len(tables) == 2 and not (torch.equal(tables["full_attention"], tables["sliding_attention"])
                                     and scale["full_attention"] == scale["sliding_attention"]):
            _rope_kind(m, "sliding_attention")
            rope = dataclasses.replace(rope, local_inv_freq=tables["sliding_attention"],
                                       local_scaling=scale["sliding_attention"],
                                       local=tuple(t == "sliding_attention" for t in types))
        return rope
    found = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        return None
    local = [m for n, m in found if "local" in n.rsplit(".", 1)[-1]]
    main = next((m for n, m in found if all(m is not x for x in local)), found[0][1])
    rope = Rope(_rope_kind(main, length=not local), main.inv_freq, float(getattr(main, "attention_scaling", 1.0)))
    if rope.kind in LENGTH_ROPE:
        return _length_rope(config, main, rope)
    if len(local) == 1 and "sliding_attention" in types and "full_attention" in types:
        rope = dataclasses.replace(rope, local_inv_freq=local[0].inv_freq,
                                   local_scaling=float(getattr(local[0], "attention_scaling", 1.0)),
                                   local=tuple(t == "sliding_attention" for t in types))
        _rope_kind(local[0])
    return rope


def _attn_softcap(config) -> float | None:
    """The attention scores' soft cap as the model's own forward applies it: transformers 4.x ran
    Gemma 2 through SDPA by default, which drops the cap without a word (5.x runs it eagerly and
    refuses SDPA with a cap), so under SDPA the model as given has no cap and neither does its
    fast decoder (with the cap it missed the forward by 0.12 relative; transformers 4.57)."""
    cap = _cfg(config, "attn_logit_softcapping")
    return None if getattr(config, "_attn_implementation", None) == "sdpa" else cap


# How a rotary head's dimensions pair up, and whether a layer's two norms come before or after its parts,
# are in the model's code, not its config or structure: api.py builds the decoder each way in turn and
# keeps the first its float32 check passes.
ROPE_PAIRS = ("halves", "interleaved")
NORM_PLACES = ("pre", "post")
# Whether layers of full attention rotate, where some layers slide: Cohere 2 (Command R7B, Command A) and
# EXAONE 4 rotate only in their sliding layers (a rule in their code); "all": every layer rotates
ROTARY_ON = ("all", "sliding")


def _rotary_layers(config, n_layers: int, rotary_on: str = "all") -> tuple | None:
    """Per layer, whether it rotates; None: every layer does. SmolLM3's ``no_rope_layers`` (1 where it
    rotates, 0 for a NoPE layer: no positions in attention at all); ``rotary_on="sliding"``: only the
    sliding layers of ``layer_types`` (ROTARY_ON)."""
    flags = getattr(config, "no_rope_layers", None)
    flags = (True,) * n_layers if flags is None else tuple(bool(f) for f in flags)
    if len(flags) != n_layers:
        raise Unsupported(f"config.no_rope_layers has {len(flags)} entries for {n_layers} layers")
    if rotary_on == "sliding":
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != n_layers or len(set(types)) < 2 or getattr(config, "sliding_window", None) is None:
            raise Unsupported("rotary on sliding layers only, asked of a model without both kinds of layer")
        flags = tuple(f and t == "sliding_attention" for f, t in zip(flags, types, strict=True))
    return None if all(flags) else flags


def _factor(config, name: str) -> float | None:
    """A scale the model's forward applies from a config field (Granite's residual_multiplier and
    logits_scaling, Cohere's logit_scale); None where it is absent or 1. Which field does what is the
    transformers code's (a field read wrongly fails the float32 check: api._structure)."""
    v = getattr(config, name, None)
    return None if v is None or float(v) == 1.0 else float(v)


def _qk_norms(attn: nn.Module, n_heads: int, n_kv: int, head_dim: int) -> tuple[list, str]:
    """The attention's q and k norms: per head (Qwen3, Gemma 3), or over all heads at once (OLMo 2: widths
    heads * head_dim and kv heads * head_dim, before the heads are split); none: []."""
    per_head = [m for m in attn.children() if _is_norm(m, head_dim)]
    if len(per_head) == 2:
        return per_head, "head"
    q = [m for m in attn.children() if _is_norm(m, n_heads * head_dim)]
    k = q if n_kv == n_heads else [m for m in attn.children() if _is_norm(m, n_kv * head_dim)]
    if n_kv == n_heads and len(q) == 2:
        return q, "full"
    if n_kv != n_heads and len(q) == 1 and len(k) == 1:
        return [q[0], k[0]], "full"
    return [], "head"


def read(model: nn.Module, pairs: str = "halves", norms_at: str = "pre",
         rotary_on: str = "all") -> tuple[DecoderSpec, Parts]:
    """The spec and parts of a decoder-only causal LM, or Unsupported with the reason. ``pairs``: how the
    rotary dimensions pair up (ROPE_PAIRS); ``norms_at``: where a two-norm layer's norms sit (NORM_PLACES);
    ``rotary_on``: which layers rotate (ROTARY_ON)."""
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
    if getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("config.use_bidirectional_attention is set: every token sees the later ones (an "
                          "encoder, as EmbeddingGemma), so there is nothing to decode")
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
        raise Unsupported("OPT's post-norm layers (config.do_layer_norm_before=False: no final norm, norms after "
                          "the residual add) are not in the fast path")
    finals = [m for m in parent.children() if _is_norm(m, hidden)]
    if len(finals) != 1:
        raise Unsupported(f"expected one final norm beside the layer stack, found {len(finals)}")
    if any(_is_proj(m) for m in parent.children()):
        raise Unsupported("projections outside the layers (e.g. OPT project_in/out) are not in the fast path")
    rope = _rotary(model, config, getattr(config, "layer_types", None))

    blocks, scalings = [], []
    qkv_layout = mlp_kind = shape = None
    transposed = qk_norm = False
    for blk in layers:
        attn, projs = _attention(blk)
        norms = [m for m in blk.children() if _is_norm(m, hidden)]
        if len(norms) not in (1, 2, 4):
            raise Unsupported(f"{type(blk).__name__} has {len(norms)} norms at the hidden width (the fast path "
                              "knows pre-norm layers with two, one shared by parallel attention and MLP, and "
                              "Gemma 2/3's four: before and after each part)")
        # four: in transformers' order, before attention, after it, before the MLP, after it; one: attention
        # and MLP side by side on the same normed input (Phi-2, Cohere): x + attn(n(x)) + mlp(n(x))
        sandwich, shared = len(norms) == 4, len(norms) == 1
        pre1, pre2 = (norms[0], norms[2]) if sandwich else (norms[0], norms[0]) if shared else norms
        post1, post2 = (norms[1], norms[3]) if sandwich else (None, None)
        if norms_at == "post":
            if len(norms) != 2:
                raise Unsupported(f"post-norm reading asked of a layer with {len(norms)} norms")
            # x + n1(attn(x)), then x + n2(mlp(x)): the sandwich form with nothing before each part
            pre1, pre2, post1, post2 = nn.Identity(), nn.Identity(), norms[0], norms[1]
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
        head_norms, qk_width = _qk_norms(attn, n_heads, n_kv, head_dim)
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
        if (qkv_layout, mlp_kind, shape) not in ((None, None, None), (layout, kind, len(norms))):
            raise Unsupported("layers differ in structure")
        qkv_layout, mlp_kind, shape = layout, kind, len(norms)
        scalings.append(float(getattr(attn, "scaling", head_dim ** -0.5)))
        blocks.append(Block(pre1, pre2, qkv, outs[0], mlp_in, rest[0], act,
                            head_norms[0] if qk_norm else None, head_norms[1] if qk_norm else None, post1, post2))

    if rope is not None:
        rope_type = rope.kind
        positions, rotary_dim = "rotary", 2 * rope.inv_freq.numel()
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
        parallel_residual=bool(getattr(config, "use_parallel_residual", False)) or shape == 1, qk_norm=qk_norm,
        scaling=tuple(scalings), max_positions=int(_cfg(config, "max_position_embeddings", "n_positions",
                                                        default=2048)),
        sliding_window=window,
        embed_scale=_embedding_scale(model, embed, layers[0], hidden) if positions == "rotary" else None,
        windowed=windowed, sandwich=sandwich or norms_at == "post", attn_softcap=_attn_softcap(config),
        final_softcap=_cfg(config, "final_logit_softcapping"), local_rope=rope.local if rope else None,
        long_after=rope.long_after if rope else None, rope_pairs=pairs if rope else "halves",
        rotary_layers=_rotary_layers(config, n_layers, rotary_on) if rope else None,
        residual_scale=_factor(config, "residual_multiplier"), logit_scale=_factor(config, "logit_scale"),
        logit_divisor=_factor(config, "logits_scaling"), qk_norm_width=qk_width, norm_place=norms_at)
    parts = Parts(embed, pos_embed if positions == "learned" else None, blocks, finals[0], head,
                  rope.inv_freq if rope else None, rope.scaling if rope else 1.0,
                  rope.local_inv_freq if rope else None, rope.local_scaling if rope else 1.0,
                  rope.long_inv_freq if rope else None)
    return spec, parts
