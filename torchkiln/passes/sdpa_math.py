"""Route F.scaled_dot_product_attention to the plain
math form where that is measured faster on this machine, or SDPA itself.

Why hand-written: on CPU, torch's flash-attention kernel parallelises over
batch x heads only; at short sequences (bert-base, batch 1, seq 128: 12 work
items on 2 cores) two oneDNN batched GEMMs and a softmax were measured 2x
faster (173 vs 351 us per layer in bf16: benchmarks/micro.py in RESULTS.md).
torch has no switch for this, and
inductor lowers SDPA straight to the flash kernel. So a TorchFunctionMode, entered
by the runner (no global patching), swaps SDPA calls for the math form: the opaque
custom op ``torchkiln::sdpa_math`` in eager, ``math_attention`` inline while traced
(dynamo traces the mode; inductor fuses the softmax and calls the GEMMs).

The other op, ``torchkiln::sdpa``, is SDPA behind a wall: given an attention
mask that is a traced value (transformers keeps it while being traced),
inductor decomposes SDPA into a math/safe-softmax kernel of its own and loses
the flash/cuDNN/efficient kernels eager would pick. Opaque, the call keeps
eager's kernel selection inside a compiled graph.

``attention()`` wraps either op with SDPA's semantics (zeros for a query row that
sees no key, on every device) and the mask clean-ups that keep GPU kernels usable;
it runs in the traced graph, so that work fuses with the kernels around it.

Modes: "auto" (CPU) chooses per (q/k/v shapes, dtype, causal, gqa) key by
timing both forms on the real inputs of a calibration call; a shape never
calibrated keeps plain SDPA. "auto-bf16" also times the math form run in bf16 for
float32 inputs: planned only for int8 models on CPUs with native bf16, whose error
budget is the quantization's (quantization/plan.py says why). The mask is not part of the key: it adds about as
much to either form (a few percent of SDPA's time in an ad-hoc check), and
models such as transformers' drop an all-ones mask in eager but keep it while
being traced. "opaque" (accelerators) sends every dropout-free call to
``torchkiln::sdpa``, unmeasured.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..timing import median_seconds


def math_attention(q, k, v, attn_mask, is_causal: bool, scale, enable_gqa: bool, dropout=None,
                   opaque_softmax: bool = False, fused: bool = False) -> torch.Tensor:
    """SDPA as two batched GEMMs and a softmax, in plain traceable ops. Under torch.compile
    the router calls this inline rather than through the opaque ``torchkiln::sdpa_math``:
    inductor then fuses the mask and softmax into one C++ kernel and calls the GEMMs
    directly. bert-base bf16 bs1 seq128 on a 2-core Zen 4 (AVX512_BF16), one process,
    interleaved: 75.6 ms inline against 80.0 ms through the opaque op (RESULTS.md).
    ``dropout``: applied to the attention probabilities (training; passes/hash_dropout.py).
    ``opaque_softmax`` (inference only): the softmax as ``torchkiln::softmax_lastdim`` instead,
    and a mask shared by every batch and head added by the first GEMM (the router sets it
    where measured faster: FORMS). ``fused`` (with ``opaque_softmax``, bf16 inputs): the whole
    attention as the C++ op ``torchkiln::attention_bf16`` where it applies (_fused_attention)."""
    if enable_gqa and k.size(-3) != q.size(-3):
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    if fused and opaque_softmax and dropout is None and not q.requires_grad and not is_causal:
        out = _fused_attention(q, k, v, attn_mask, scale)
        if out is not None:
            return out
    # Scaling q (L x E) is cheaper than scaling the scores (L x S), and gives a
    # contiguous operand for the batched GEMM.
    q = q * (scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    opaque = opaque_softmax and dropout is None and not q.requires_grad
    # One mask for every batch and head: added by the first GEMM (baddbmm), not by a pass over the scores.
    folded = opaque and attn_mask is not None and not is_causal and all(d == 1 for d in attn_mask.shape[:-2])
    s = _scores_plus(q, k, attn_mask) if folded else torch.matmul(q, k.transpose(-2, -1))
    keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril() if is_causal else None
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    dead = None
    if attn_mask is not None:
        if not folded:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        # SDPA (torch >= 2.5) gives 0, not NaN, for a query row with every key
        # masked out, as left-padded decoder batches have. Found on the mask,
        # which is broadcast over heads: much less work than a pass over the
        # scores. Causal alone never empties a row (column 0 always stays).
        live = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        dead = ~(live if keep is None else live & keep).any(-1, keepdim=True)
    # torch's CPU/CUDA softmax accumulates low-precision inputs in fp32 already.
    probs = softmax_lastdim(s) if opaque else torch.softmax(s, -1)
    out = torch.matmul(probs if dropout is None else dropout(probs), v)
    return out if dead is None else out.masked_fill(dead, 0.0)


def _fused_attention(q, k, v, attn_mask, scale):
    """``torchkiln::attention_bf16`` (kernels/cpu_attention.cpp: oneDNN's matmuls and softmax, one op
    called from inductor's C++ wrapper without Python): 132 against 225 us per bert-base layer for
    this form's baddbmm + opaque softmax + bmm (bs1, seq 128, 2-core Zen 5, eager; RESULTS.md
    "attention as one op"). None where it does not apply (then the unfused form runs)."""
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype or q.dim() != 4 or q.device.type != "cpu":
        return None
    if attn_mask is not None and (attn_mask.dim() != 4 or attn_mask.dtype not in (torch.bool, torch.bfloat16,
                                                                                   torch.float32)):
        return None
    bias = None if attn_mask is None else _as_bias(attn_mask, torch.bfloat16).contiguous()
    out = torch.ops.torchkiln.attention_bf16(q, k, v, bias, scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    if bias is None:
        return out
    # SDPA's zeros for a query row that sees no key (math_attention's ``dead``), found on the mask
    dead = ~(bias > float("-inf")).any(-1, keepdim=True)
    return out.masked_fill(dead, 0.0)


def _scores_plus(q, k, attn_mask):
    """q @ k^T + the mask (as a bias in q's dtype), in one baddbmm; the mask's leading dims are 1."""
    L, S, E = q.size(-2), k.size(-2), q.size(-1)
    n = q.numel() // (L * E)
    bias = _as_bias(attn_mask, q.dtype).reshape(1, *attn_mask.shape[-2:]).expand(n, L, S)
    return torch.baddbmm(bias, q.reshape(n, L, E), k.reshape(n, S, E).transpose(1, 2)).view(*q.shape[:-1], S)


def _as_bias(attn_mask, dtype):
    """An attention mask as an additive bias in ``dtype`` (a bool mask's False: -inf)."""
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(dtype)


@torch.library.custom_op("torchkiln::softmax_lastdim", mutates_args=())
def softmax_lastdim(x: torch.Tensor) -> torch.Tensor:
    """torch.softmax over the last dim, opaque to inductor. Why: inductor's own CPU softmax kernel
    (a max pass, exp stored in fp32, then a sum and a divide pass; the mask rebuilt from the int64
    attention_mask inside each) took 187 us per bert-base layer (bs1, seq 128, 12 heads, 2-core
    Zen 4) against eager's 73 (+19 us for the call through Python) and a 13-us bias in baddbmm.
    bert-base int8 bs1: 1.058-1.070x (benchmarks/diag_opaque_softmax.py; RESULTS.md)."""
    return torch.softmax(x, -1)


@softmax_lastdim.register_fake
def _(x):
    return x.new_empty(x.shape)


def low_math_attention(q, k, v, attn_mask, is_causal: bool, scale, enable_gqa: bool,
                       dtype: torch.dtype = torch.bfloat16, opaque_softmax: bool = False,
                       fused: bool = False) -> torch.Tensor:
    """``math_attention`` computed in ``dtype``, returned in q's dtype. Used for float32
    inputs of int8 models only, where bf16's ~0.4% rounding of the scores sits below the
    int8 activations' own error (the guard still checks the model against its quantized
    reference)."""
    if attn_mask is not None:
        # A bool mask as an additive bias: inductor otherwise recomputes it (from the model's int64
        # attention_mask) inside both passes of every layer's softmax. 12 bert-base layers, bs1,
        # seq 128, compiled, 2-core Zen 4: 4.95 ms against 5.68 with the bool mask (/tmp diag).
        attn_mask = _as_bias(attn_mask, dtype)
    out = math_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask, is_causal, scale, enable_gqa,
                         opaque_softmax=opaque_softmax, fused=fused)
    return out.to(q.dtype)


@torch.library.custom_op("torchkiln::sdpa_math", mutates_args=())
def sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
              is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """The eager form of ``math_attention``. Opaque to the compiler, so it may look at
    data: an all-pass mask (which traced models keep) costs a full pass over the scores
    for nothing. Not on accelerators: the check is a host sync, and breaks CUDA-graph capture."""
    return math_attention(q, k, v, _all_pass_dropped(q, attn_mask), is_causal, scale, enable_gqa)


def _all_pass_dropped(q, attn_mask):
    if (attn_mask is not None and q.device.type == "cpu"
            and bool(attn_mask.all() if attn_mask.dtype == torch.bool else not attn_mask.any())):
        return None
    return attn_mask


@sdpa_math.register_fake
def _(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("torchkiln::sdpa_math_bf16", mutates_args=())
def sdpa_math_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                   is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """The eager form of ``low_math_attention`` in bf16 (opaque, as ``sdpa_math``)."""
    return low_math_attention(q, k, v, _all_pass_dropped(q, attn_mask), is_causal, scale, enable_gqa)


@sdpa_math_bf16.register_fake
def _(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _aten_sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    # The aten op is what F.scaled_dot_product_attention dispatches to; called
    # directly, it is not caught again by a router still entered around the
    # compiled model. enable_gqa only when set: older torch lacks the argument.
    gqa = {"enable_gqa": True} if enable_gqa else {}
    return torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale, **gqa)


@torch.library.custom_op("torchkiln::sdpa", mutates_args=())
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
         is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    return _sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa)


@sdpa.register_fake
def _(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    # SDPA's output strides follow q's layout and the kernel chosen, and inductor
    # asserts an extern op's real strides against the fake's: the same code decides.
    return _sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def _sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    if attn_mask is not None and attn_mask.stride(-1) != 1 and q.device.type != "cpu":
        attn_mask = attn_mask.contiguous()  # GPU kernels need a unit last stride (CPU's do not)
    return _aten_sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def attention(q, k, v, attn_mask, is_causal: bool, scale, enable_gqa: bool, op=None) -> torch.Tensor:
    """SDPA's semantics around an opaque op (default ``torchkiln::sdpa``): a query row
    that sees no key gives zeros on every device. The mask handling stays outside the
    op, in the traced graph, where the compiler fuses it with the kernels around it
    (inside, it cost 1-2 extra kernels per layer)."""
    op = op or torch.ops.torchkiln.sdpa
    rows = None
    if attn_mask is not None and (attn_mask.size(-1) == 1 or attn_mask.stride(-1) == 0):
        # A mask constant along the keys (stride 0: transformers 5.17, traced with
        # attention_mask=None, builds an expanded all-True one) lets each query row see
        # every key or none. No GPU kernel takes a mask whose last stride is not 1, so
        # SDPA fell back to math: 587 vs 54 us per bert-base layer at bs64 on the H200
        # (benchmarks/diag_sdpa_args.py). Exactly equivalent: no mask, then zero the
        # rows that see no key (an additive constant does not change a softmax).
        row = attn_mask[..., :1]
        rows = row if row.dtype == torch.bool else row > float("-inf")
        attn_mask = None
    elif attn_mask is not None and q.device.type != "cpu":
        # CUDA's fused kernels (efficient attention, H200, torch 2.11) return garbage,
        # not zeros, for a row whose keys are all masked; CPU SDPA returns zeros.
        # Found on the mask, broadcast over heads; no host sync: safe in CUDA graphs.
        rows = attn_mask.any(-1, keepdim=True) if attn_mask.dtype == torch.bool else \
            ~torch.isneginf(attn_mask).all(-1, keepdim=True)
    out = op(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    return out if rows is None else out.masked_fill(~rows, 0)


def _fused_loads() -> bool:
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False  # oneDNN's bf16 matmul and softmax are AVX-512 kernels (no win measured elsewhere)
    from ..kernels import cpu_attention
    return cpu_attention.load() is None


SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)  # as graphs call it


def bind_sdpa(args, kwargs) -> dict:
    """SDPA's arguments by name, defaults filled in."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    # no zip(..., strict=False): dynamo traces this (inside compiled callers), and torch 2.6's
    # dynamo read any strict= as strict, so every compiled candidate with attention failed there
    bound = {**defaults, **{names[i]: a for i, a in enumerate(args)}, **kwargs}
    return bound


def _autocast(b):
    # Autocast runs SDPA in its low precision, but once compiled it cannot see
    # into an opaque op, which would then run in fp32: cast as autocast would.
    dev = b["query"].device.type
    if not torch.is_autocast_enabled(dev):
        return b
    dt = torch.get_autocast_dtype(dev)
    cast = {n: b[n].to(dt) for n in ("query", "key", "value", "attn_mask")
            if b[n] is not None and b[n].is_floating_point() and b[n].dtype != torch.float64}
    return {**b, **cast}


def _key(b) -> tuple:
    return tuple(tuple(b[n].shape) for n in ("query", "key", "value")), *_rest(b)


def _rest(b) -> tuple:
    return str(b["query"].dtype), bool(b["is_causal"]), bool(b["enable_gqa"])


# The forms the router chooses between: eager (an opaque op) and traced (inline, for
# inductor to fuse: math_attention's docstring). SDPA is opaque in eager, inline traced (_route).
# The third field: whether the inline form may call softmax as the opaque ``torchkiln::softmax_lastdim``
# (math_attention says why). Measured per form, bert-base bs1 seq128, 2-core Zen 4, one process,
# interleaved: int8 (math-bf16) 1.058-1.070x (benchmarks/diag_opaque_softmax.py); the bf16 and fp32
# models (math), with the flag applied to every form in an ad-hoc A/B, 0.993x and 0.989x, so not there.
FORMS = {"math": (math_attention, "sdpa_math", False), "math-bf16": (low_math_attention, "sdpa_math_bf16", True)}


class _Choices(dict):
    """A router's measured choices; a write (by _measure, or by hand in a test or a benchmark) updates
    the router's ``traced`` forms too."""

    def __init__(self, router: SDPARouter, items: dict):
        super().__init__(items)
        self.router = router

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        router = self.__dict__.get("router")  # unpickling sets the items before the attribute
        if router is not None:
            router._retrace()


class SDPARouter(TorchFunctionMode):
    """Enter around a model call. mode="auto": ``calibrating=True`` measures unseen
    shapes on real inputs (CPU); "auto-bf16": also the math form in bf16, for float32
    inputs; mode="opaque": every call goes to torchkiln::sdpa."""

    # Read once per router, at construction (a compiled graph keeps what it was traced with):
    # benchmarks/diag_opaque_softmax.py flips it to build the other variant in the same process.
    OPAQUE_SOFTMAX = True
    # The same for the fused attention op (math_attention's ``fused``), taken where it builds here.
    FUSED_ATTENTION = True

    def __init__(self, mode: str = "auto"):
        super().__init__()
        if mode not in ("auto", "auto-bf16", "opaque"):
            raise ValueError(f"SDPARouter mode must be 'auto', 'auto-bf16' or 'opaque', not {mode!r}")
        self.mode = mode
        self.timings: dict[tuple, dict[str, float]] = {}  # key -> {form: seconds}
        self.choices = {}  # key -> "sdpa" | "math" | "math-bf16" (and ``traced``: (dtype, causal, gqa) -> form)
        self.calibrating = False
        self.seen = 0  # attention calls met (Runner.calibrate drops a router that met none)
        self.opaque_softmax = type(self).OPAQUE_SOFTMAX
        # Loaded (built on first use, ~10 s once per machine) here, not while traced. Only the int8
        # models' bf16 form takes it: their error budget is the quantization's (low_math_attention).
        self.fused = mode == "auto-bf16" and self.opaque_softmax and type(self).FUSED_ATTENTION and _fused_loads()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if not torch.compiler.is_compiling():  # traced, the count is a guard: every call would recompile
            self.seen += 1
        b = bind_sdpa(args, kwargs)
        tensors = [b[n] for n in ("query", "key", "value", "attn_mask") if b[n] is not None]
        # The ops have no backward.
        if b["dropout_p"] or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return func(*args, **kwargs)
        b = _autocast(b)
        op = self._route(b)
        if op is None:
            return func(*args, **kwargs)
        return attention(b["query"], b["key"], b["value"], b["attn_mask"], bool(b["is_causal"]), b["scale"],
                         bool(b["enable_gqa"]), op)

    def _route(self, b):
        if self.mode == "opaque":
            return torch.ops.torchkiln.sdpa
        if b["query"].device.type != "cpu":
            return None
        if torch.compiler.is_compiling():
            # Traced: one form per (dtype, causal, gqa), never a lookup by shape. A lookup guards on the
            # sizes (dynamo reads symbolic sizes as ints), so a graph compiled for many sequence lengths
            # recompiled at each one: padding per batch cost 3-5 s per new length for a tiny BERT and 6-7 s
            # for a small BART on a 2-core Zen 5, where stock torch.compile compiles twice in all.
            form = self.traced.get(_rest(b))
        else:
            key = _key(b)
            if self.calibrating and key not in self.choices:
                self._measure(key, b)
            form = self.choices.get(key)
        if form is None:
            return None
        if form == "sdpa":
            # Traced on the CPU, SDPA inline: inductor keeps its flash kernel there (the wall is for GPUs)
            # and turns a bool mask into the float one the kernel takes in 15 us, where through the wall
            # its bool copies took 365 us, and each opaque call ~100 us of Python: MiniLM fp32 bs16 seq61,
            # 6 layers, 2-core Zen 5 (torch.profiler; RESULTS.md, thirtieth session).
            return _aten_sdpa if torch.compiler.is_compiling() else torch.ops.torchkiln.sdpa
        inline, op, opaque = FORMS[form]
        if not torch.compiler.is_compiling():
            return getattr(torch.ops.torchkiln, op)
        if inline is low_math_attention:
            return functools.partial(inline, opaque_softmax=opaque and self.opaque_softmax, fused=self.fused)
        return functools.partial(inline, opaque_softmax=opaque and self.opaque_softmax)

    @property
    def choices(self) -> dict[tuple, str]:
        return self._choices

    @choices.setter
    def choices(self, value: dict[tuple, str]) -> None:
        self._choices = _Choices(self, value)
        self._retrace()

    def _retrace(self) -> None:
        # Read by traced code as a plain dict: dynamo guards on its contents (so a changed choice
        # recompiles), and computing it there would not trace (min with a key).
        if "_choices" in self.__dict__:  # (a copy being made: its own traced forms are copied as well)
            self.traced = {k[1:]: self._traced_form(k[1:]) for k in self._choices}

    def _traced_form(self, rest: tuple) -> str | None:
        """The form for every shape of this (dtype, causal, gqa) group in a traced graph: the one its
        measured shapes chose where they agree; otherwise the one with the least time summed over them
        (a small BART: math 142 vs SDPA 145 us at its encoder's shape, SDPA 28 vs 43 and 47 vs 54 at the
        decoder's: SDPA for all, 3 us given up), or, unmeasured (set by hand), the most chosen."""
        group = [k for k in self.choices if k[1:] == rest]
        chosen = [self.choices[k] for k in group]
        if len(set(chosen)) <= 1:
            return chosen[0] if chosen else None
        forms = sorted(set.intersection(*(set(self.timings.get(k, ())) for k in group)))
        if forms:
            return min(forms, key=lambda f: (sum(self.timings[k][f] for k in group), f != "sdpa"))
        return max(sorted(set(chosen)), key=chosen.count)

    def _measure(self, key, b) -> None:
        q, k, v, m = b["query"], b["key"], b["value"], b["attn_mask"]
        rest = (b["is_causal"], b["scale"], b["enable_gqa"])
        forms = {"sdpa": (sdpa, (q, k, v, m)), "math": (sdpa_math, (q, k, v, m))}
        if self.mode == "auto-bf16" and q.dtype == torch.float32:
            # The fp32 math form is not timed here: on the CPUs this mode is planned for, bf16's
            # GEMMs run at twice fp32's rate, and the bf16 form replaces it. It is timed on inputs
            # cast beforehand: compiled, the casts fuse into the kernels that produce q, k and v.
            # Eager, at bert-base's shapes on a 2-core Zen 4, they cost ~16% (504 against 427 us
            # per layer; SDPA 612), and the calibration timed the two forms 686 vs 642 us: a
            # margin that noise could flip.
            low = [t.to(torch.bfloat16) if t is not None and t.is_floating_point() else t for t in (q, k, v, m)]
            forms = {"sdpa": forms["sdpa"], "math-bf16": (sdpa_math, tuple(low))}
        with torch.no_grad():
            self.timings[key] = {n: median_seconds(lambda op=op, a=a: attention(*a, *rest, op))
                                 for n, (op, a) in forms.items()}
        t = self.timings[key]
        # Eager forms are timed here, but a compiled model runs the math forms inline, where
        # inductor fuses their softmax: at equal eager times the compiled math form measured
        # 1.05x SDPA's flash kernel (bert-base fp32 bs1, 2-core Zen 4; RESULTS.md). So math
        # wherever it is not slower eager.
        self._choices[key] = min(t, key=lambda n: (t[n], n == "sdpa"))

    def summary(self) -> str:
        if self.mode == "opaque":
            return "opaque: every dropout-free SDPA call runs as torchkiln::sdpa"
        used = sum(c != "sdpa" for c in self.choices.values())
        forms = sorted({c for c in self.choices.values() if c != "sdpa"}) or ["math"]
        parts = [" vs ".join(f"{n} {1e6 * s:.0f}" for n, s in t.items()) + " us" for t in self.timings.values()]
        return (f"{self.mode}: {'/'.join(forms)} attention for {used}/{len(self.choices)} shapes, torchkiln::sdpa "
                f"for {len(self.choices) - used} ({', '.join(parts)})")
