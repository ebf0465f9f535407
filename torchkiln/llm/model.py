"""The fast decoder: one forward for every family a DecoderSpec describes, over a static KV cache.

gpt-fast's shape (pre-allocated cache written in place, a boolean mask over the whole cache,
one forward for prefill and decode), run over the model's own modules: the embedding, norms
and activation are the model's objects, so their numerics (Gemma's 1+w RMSNorm, the embedding
scale, GELU variants) are exactly the model's; only attention, rotary and the projections are
written here. Projections are fused (one GEMM for q/k/v, one for gate/up): at batch 1 each
GEMM is a weight read plus a fixed launch cost, and fewer launches is what the decode step
is short of.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..captured import captured
from ..kernels import cpu_gemv
from ..modelutil import first_line, is_oom
from ..quantization import gemv
from ..timing import interleaved
from . import decode_attention, fused, qkv_rope
from .spec import DecoderSpec, Parts

_fresh_ids = itertools.count()


def _weight(m: nn.Module, transposed: bool) -> torch.Tensor:
    return m.weight.t() if transposed else m.weight


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None, cls: type = nn.Linear) -> nn.Linear:
    """An nn.Linear (or ``cls``, a subclass) over existing tensors (no copy): torchao's quantize_
    and the compiler both want real nn.Linear modules."""
    lin = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def fuse(mods: list, transposed: bool) -> nn.Linear:
    """One Linear computing ``mods`` side by side. Several modules: their weights are copied
    into one tensor and each module's own parameter becomes a view of its rows, so the model's
    forward, state_dict and load_state_dict keep working on the same memory (checkpoints load
    both ways, nothing is held twice)."""
    if len(mods) == 1:
        m = mods[0]
        return linear_of(_weight(m, transposed), m.bias)
    weight = torch.cat([_weight(m, transposed).detach() for m in mods])
    has_bias = [m.bias is not None for m in mods]
    bias = torch.cat([m.bias.detach() for m in mods]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.weight.shape[0])
                          for m in mods])
    row = 0
    for m in mods:
        n = _weight(m, transposed).shape[0]
        view = weight[row:row + n]
        m.weight = nn.Parameter(view.t() if transposed else view, requires_grad=m.weight.requires_grad)
        if m.bias is not None:
            m.bias = nn.Parameter(bias[row:row + n], requires_grad=m.bias.requires_grad)
        row += n
    return linear_of(weight, bias)


class Side(nn.Module):
    """``mods``' outputs side by side, each over its own weight (no copy): what ``fuse`` computes, for a
    decoder built only to be checked (api._structure), where a fused copy of the weights would be
    memory for nothing (llama-1b bf16 in place: the check's peak 8.8 GB with the copy, 6.8 GB without)."""

    def __init__(self, mods: list, transposed: bool):
        super().__init__()
        self.parts = nn.ModuleList(linear_of(_weight(m, transposed), m.bias) for m in mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.parts], dim=-1)


@functools.cache
def _register_linear() -> None:
    """torchkiln::linear, F.linear as an op the compiler cannot look into (registered on first use)."""

    @torch.library.custom_op("torchkiln::linear", mutates_args=())
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @linear.register_fake
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])


class CublasLinear(nn.Linear):
    """An nn.Linear the compiler keeps as one cuBLAS call. Why, for the CUDA decode step's output
    and down projections: inductor turns batch-1 matmuls into Triton reductions with their
    neighbours fused in, and for these two the fused kernels were slower than cuBLAS plus a
    separate pointwise kernel (H200, Llama-3-8B bf16 profile: o 17.0 us with its residual add
    against 13.3 for cuBLAS alone; down 39.9 us with SiLU x up against 31.5 + 1.4;
    benchmarks/RESULTS.md). For q/k/v, gate/up and the head, whose fused neighbour is a norm,
    the fused kernels were as fast, so those stay with inductor. Still an nn.Linear: weight-only
    quantization replaces it like any other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.torchkiln.linear(x, self.weight, self.bias)


def cublas_projections(decoder: nn.Module, on: bool = True) -> int:
    """Make each layer's ``out`` and ``down`` a CublasLinear (``on=False``: a plain nn.Linear
    again); returns how many changed. Same tensors, no copy."""
    if on:
        _register_linear()
    kind = CublasLinear if on else nn.Linear
    done = 0
    for layer in decoder.layers:
        for name in ("out", "down"):
            m = getattr(layer, name)
            if type(m) in (nn.Linear, CublasLinear) and type(m) is not kind:
                setattr(layer, name, linear_of(m.weight, m.bias, kind))
                done += 1
    return done


class TritonLinear(nn.Linear):
    """An nn.Linear whose one-row product on CUDA is torchkiln's float GEMV
    (quantization/gemv.py, ``torchkiln::float_gemv``, opaque to the compiler); more rows: F.linear.
    ``cuda_projections`` swaps it in for a projection only where it timed faster than cuBLAS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() != 1 or not x.is_cuda:
            return F.linear(x, self.weight, self.bias)
        y = gemv.float_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


def graph_times(forms: dict, weights: list[torch.Tensor], rounds: int = 5) -> dict[str, float]:
    """us per call of each ``forms`` function (x, weight) over ``weights`` (the layers', so each
    call reads its weight from memory, as in decode), one CUDA graph per form, replays
    interleaved over ``rounds``; medians. Eager calls go first: they tune Triton kernels and set
    up cuBLAS outside any capture."""
    dev = weights[0].device
    x = torch.randn(1, 1, weights[0].shape[1], device=dev, dtype=weights[0].dtype)
    graphs = {}
    with torch.no_grad():
        for name, fn in forms.items():
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn(x, weights[0])
            torch.cuda.current_stream(dev).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with captured(g):
                for w in weights:
                    fn(x, w)
            graphs[name] = g
        times = {name: [] for name in forms}
        for _ in range(rounds):
            for name, g in graphs.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3 / len(weights))
    return {name: statistics.median(t) for name, t in times.items()}


def cuda_projections(decoder: nn.Module) -> str | None:
    """The CUDA decode step's output and down projections: cuBLAS (CublasLinear) or torchkiln's
    float GEMV (TritonLinear), whichever times faster on the layers' own weights, each
    projection on its own. Returns the report's line (None: nothing to measure here)."""
    first = decoder.layers[0]
    if not (first.out.weight.is_cuda and first.out.weight.is_floating_point() and gemv.wanted(first.out.weight)):
        return None
    lines = []
    for name in ("out", "down"):
        mods = [getattr(layer, name) for layer in decoder.layers]
        if type(mods[0]) is not CublasLinear or mods[0].in_features % 64 or not mods[0].weight.is_contiguous():
            continue
        try:
            times = graph_times({"cuBLAS": lambda x, w: F.linear(x, w), "triton": gemv.float_linear},
                                [m.weight for m in mods])
        except Exception as e:  # noqa: BLE001 - a measurement that fails leaves cuBLAS, as before it existed
            if is_oom(e):
                raise
            lines.append(f"{name}: cuBLAS (not measured: {first_line(e)})")
            continue
        form = pick(times, "cuBLAS", margin=0.95)
        if form == "triton":
            for layer, m in zip(decoder.layers, mods, strict=True):
                setattr(layer, name, linear_of(m.weight, m.bias, TritonLinear))
        lines.append(f"{name}: " + describe(form, times, None))
    return "; ".join(lines) or None


class RowLinear(nn.Linear):
    """An nn.Linear whose one-row product (batch-1 decode), when compiled, is a multiply-and-sum
    that inductor turns into one vectorised reduction over the weight. Why, on some CPUs: on a
    2-core Zen 4 torch's GEMV (oneDNN/MKL through F.linear) read weights at 10-15 GB/s and
    inductor's reduction at 16-26 GB/s, in float32 and bf16 alike; on a 16-core Xeon the
    reduction was 0.5-1.1x F.linear (llama-350m's decode shapes, benchmarks/llm_gemv_cpu.py;
    RESULTS.md), so ``cpu_projections`` decides per machine. More rows, or eager (the product
    would be materialised): F.linear. The sum runs in float32, as a GEMM accumulates. Still an
    nn.Linear: quantization replaces it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() != 1 or not torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        return _row_product(x, self.weight, self.bias)


def _row_product(x, weight, bias):
    y = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    return (y if bias is None else y + bias.float()).to(x.dtype)


def fresh(fn):
    """``fn`` with a code object of its own: dynamo caches compiled code per code object, and a
    process that measures many models' shapes must not reach its recompile limit (past it, the
    reduction would run eagerly and materialise the product)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_fresh_ids)}")
    return types.FunctionType(code, fn.__globals__, None, fn.__defaults__, fn.__closure__)


class KernelLinear(nn.Linear):
    """An nn.Linear whose one-row product (batch-1 decode) is torchkiln's own CPU GEMV
    (kernels/cpu_gemv.cpp), an op the compiler calls as it is, eager or compiled. Why: on a 2-core
    Zen 3 it read llama-350m's decode weights at 28-32 GB/s in float32 and 19-28 GB/s in bf16,
    against 14-19 for F.linear and 12-19 for RowLinear's reduction (benchmarks/llm_gemv_cpu.py;
    RESULTS.md, thirteenth session). ``cpu_projections`` takes it only where it measures faster
    on this machine. More rows: F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() != 1:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.torchkiln.cpu_gemv(x, self.weight, None)
        return y if self.bias is None else y + self.bias


FORMS = {"reduction": RowLinear, "kernel": KernelLinear}  # one-row forms besides F.linear


def time_forms(forms: dict, args: list[tuple], rounds: int = 5) -> dict[str, float]:
    """us per call of each function in ``forms``, compiled, over ``args`` (one tuple per layer,
    cycled so the weights come from memory as in decode), interleaved over ``rounds``; each form's
    fastest round. Not the median: a burst of other work on a 2-core host slows every round it
    overlaps and only ever adds time, and a llama-350m build once timed the int8 kernel at 1737 us
    (424-557 us in the builds before and after) and kept the slower form (RESULTS.md, nineteenth
    session)."""
    forms = {name: torch.compile(fresh(fn), dynamic=False) for name, fn in forms.items()}
    with torch.no_grad():
        for fn in forms.values():  # warm-up: compiles
            [fn(*a) for a in args[:2]]
        calls = {name: (lambda fn=fn: [fn(*a) for a in args]) for name, fn in forms.items()}
        times = interleaved(calls, torch.device("cpu"), 0.0, min_rounds=rounds, max_rounds=rounds, prune=1e9)
    return {name: min(t) / len(args) * 1e6 for name, t in times.items()}


def pick(times: dict[str, float], base: str, margin: float = 0.9) -> str:
    """The fastest form, if it beats ``base`` by 1 - ``margin`` (a swap is only worth a clear
    win: 10% unless said), else ``base``."""
    best = min(times, key=times.get)
    return best if best != base and times[best] < margin * times[base] else base


def row_forms(weights: list[torch.Tensor], norm: nn.Module | None = None) -> tuple[dict[str, float], str | None]:
    """us per one-row call of F.linear, RowLinear's reduction and (where it builds) the CPU
    kernel, each compiled with ``norm`` (the layers' pre-MLP norm, the model's own module) in
    front as in the decode step, on ``weights`` (same shape: the layers' widest projection); and
    why the kernel is not among them, if it is not. Why the norm: inductor fuses it into the
    reduction, which then recomputes it per weight row; alone the bf16 reduction read llama-350m's
    gate/up as fast as the kernel (825 against 850 us), after a norm it took 1060 against 882 us,
    and the decode step 52.6 against 38.4 ms per token on a 2-core Zen 3 (RESULTS.md, thirteenth
    session)."""
    x = torch.randn(1, 1, weights[0].shape[1], dtype=weights[0].dtype)
    norm = norm if norm is not None else nn.Identity()
    forms = {"F.linear": lambda x, w: F.linear(norm(x), w),
             "reduction": lambda x, w: _row_product(norm(x), w, None)}
    why = kernel_why(x.dtype, weights[0])
    if why is None:
        forms["kernel"] = lambda x, w: cpu_gemv.gemv(norm(x), w)
    return time_forms(forms, [(x, w) for w in weights]), why


def kernel_why(x_dtype: torch.dtype, weight: torch.Tensor) -> str | None:
    """Why torchkiln's CPU GEMV cannot serve this weight for inputs of ``x_dtype`` (None: it can)."""
    return cpu_gemv.load() or (None if cpu_gemv.fits(x_dtype, weight) else f"no {x_dtype} form")


def describe(form: str, times: dict[str, float], why: str | None) -> str:
    line = f"{form} (" + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()) + ")"
    return line + (f"; kernel not used: {why}" if why else "")


def cpu_projections(decoder: nn.Module) -> str | None:
    """The CPU's compiled decode: the one-row form of the dense projections that ``row_forms``
    measures fastest here. Returns the report's line (None: no float projection to measure)."""
    ups = [layer.up.weight for layer in decoder.layers if layer.up.weight.is_contiguous()]
    if not ups or not ups[0].is_floating_point():
        return None
    times, why = row_forms(ups, getattr(decoder.layers[0], "norm2", None))
    form = pick(times, "F.linear")
    if form in FORMS:
        row_projections(decoder, FORMS[form])
    return describe(form, times, why)


def row_projections(decoder: nn.Module, cls: type = RowLinear) -> int:
    """Make every dense float Linear of the decoder (layers and head) with a contiguous weight a
    ``cls`` (RowLinear or KernelLinear); returns how many changed. Same tensors, no copy."""
    done = 0
    for parent in [decoder, *decoder.layers]:
        for name, m in list(parent.named_children()):
            # a transposed view (GPT-2's Conv1D weights) would be reduced along its strided axis
            if type(m) is nn.Linear and m.weight.is_floating_point() and m.weight.is_contiguous():
                setattr(parent, name, linear_of(m.weight, m.bias, cls))
                done += 1
    return done


# Widest query (decode, speculation checks) that attends through grouped_attention on the CPU.
CPU_MATMUL_ATTENTION = 16


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of a few queries over the whole cache as two batched matmuls and a float32 softmax,
    the query heads of each KV head stacked into one matrix (no cache copy for GQA). Why not SDPA on
    the CPU: its flash kernel took 411 us per call for one query over a 256-slot cache in
    llama-350m's bf16 decode here, 15% of the profiled time (torch.profiler, benchmarks/RESULTS.md, "LLM
    decode on the CPU"). Every row sees at least its own slot (FastDecoder's mask), so no row is
    fully masked. q (B, H, T, D); k, v (B, KV, S, D); mask (B or 1, 1, T, S), True = attend.
    ``softcap``: Gemma 2's cap * tanh(scores / cap) before the mask, which SDPA has no form of (so
    those models attend here on every device and width)."""
    B, H, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    scores = q.reshape(B, KV, H // KV * T, D).float() @ k.float().transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(B, KV, H // KV, T, S).masked_fill(~mask[:, :, None], float("-inf"))
    p = scores.softmax(dim=-1).view(B, KV, H // KV * T, S)
    return (p @ v.float()).to(q.dtype).view(B, H, T, D)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] dims of each head (the rest pass through),
    the half-split form transformers uses: x*cos + rotate_half(x)*sin; ``interleaved``: pairs (2i, 2i+1)
    (GLM, Helium, Cohere), whose tables FastDecoder makes interleaved too."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = rot * cos + torch.stack((-b, a), dim=-1).flatten(-2) * sin
    else:
        a, b = rot.chunk(2, dim=-1)
        out = rot * cos + torch.cat((-b, a), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class Layer(nn.Module):
    def __init__(self, spec: DecoderSpec, blk, index: int, fused: bool = True):
        super().__init__()
        self.spec, self.scaling = spec, spec.scaling[index]
        self.norm1, self.norm2, self.act = blk.norm1, blk.norm2, blk.act
        self.q_norm, self.k_norm = blk.q_norm, blk.k_norm
        self.post1, self.post2 = blk.post1, blk.post2
        t = spec.qkv_transposed
        join = fuse if fused else Side
        self.qkv = join(blk.qkv, t)
        self.out = linear_of(_weight(blk.out, t), blk.out.bias)
        self.up = join(blk.mlp_in, t)
        self.down = linear_of(_weight(blk.mlp_out, t), blk.mlp_out.bias)
        # the model's own module whose input each projection reads (GPTQ collects its inputs there);
        # a plain dict, not registered: they are the model's modules, not the decoder's
        self.sources = {"qkv": blk.qkv[0], "out": blk.out, "up": blk.mlp_in[0], "down": blk.mlp_out}
        # buffers, so the compiler (and CUDA graphs) treat the cache as static state
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.decode_kernel = False  # one-query steps through decode_attention (set for CUDA decoders)
        self.rope_kernel = False  # one-row steps rotate and write the cache in one kernel (qkv_rope.py)
        self.folded = None  # fused.Folded: one-row int8 CUDA steps with the norms etc. in the GEMVs

    def attention(self, x, cos, sin, slots, mask, table=None):
        return self.out(self.attend(self.qkv(x), cos, sin, slots, mask, table))

    def attend(self, qkv, cos, sin, slots, mask, table=None):
        """q/k/v projections (B, T, ...) -> attention output (B, T, heads * head_dim), the cache written."""
        s = self.spec
        B, T, _ = qkv.shape
        H, KV, D = s.n_heads, s.n_kv_heads, s.head_dim
        if self.rope_kernel and table is not None and B * T == 1:
            return self.look(qkv_rope.rope_cache(qkv, *table, slots, self.k_cache, self.v_cache, H), mask)
        if s.qkv_layout == "headwise":  # [h, 3, d] rows (GPT-NeoX)
            q, k, v = qkv.view(B, T, H, 3 * D).split(D, dim=-1)
        else:
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
            if self.q_norm is not None and s.qk_norm_width == "full":  # over all heads at once (OLMo 2)
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.view(B, T, H, D), k.view(B, T, KV, D), v.view(B, T, KV, D)
        if self.q_norm is not None and s.qk_norm_width == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cos is not None:
            pairs = s.rope_pairs == "interleaved"
            q, k = rotate(q, cos, sin, pairs), rotate(k, cos, sin, pairs)
        self.k_cache.index_copy_(2, slots, k)
        self.v_cache.index_copy_(2, slots, v)
        return self.look(q, mask)

    def look(self, q, mask):
        """q (B, H, T, D), rotated, over the cache (written) -> attention output (B, T, H * D)."""
        B, H, T, D = q.shape
        KV = self.spec.n_kv_heads
        if self.spec.attn_softcap is not None:
            o = grouped_attention(q, self.k_cache, self.v_cache, mask, self.scaling, self.spec.attn_softcap)
        elif self.decode_kernel and decode_attention.usable(q, self.k_cache):
            o = decode_attention.attend(q, self.k_cache, self.v_cache, mask, self.scaling)
        elif q.device.type == "cpu" and T <= CPU_MATMUL_ATTENTION:
            o = grouped_attention(q, self.k_cache, self.v_cache, mask, self.scaling)
        else:
            # grouped KV heads go to SDPA as they are (enable_gqa, torch >= 2.5): expanding the whole
            # cache per step was two copy kernels per layer in the H200 decode profile
            o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, scale=self.scaling,
                                               enable_gqa=KV != H)
        return o.transpose(1, 2).reshape(B, T, H * D)

    def mlp(self, x):
        h = self.up(x)
        if self.spec.mlp == "gated":
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.down(h)

    def forward(self, x, cos, sin, slots, mask, table=None):
        """``table``: (the cos table, the sin table, positions), for qkv_rope's kernels to read this
        position's rows themselves (an indexed cos/sin as a custom op's input was gathered again for
        each of its callers by inductor: 15 kernels a step, Llama-3-8B int8 on the H200)."""
        if self.folded is not None and fused.one_row(x):
            return self.folded(self, x, cos, sin, slots, mask, table)
        if self.spec.parallel_residual:
            h = self.norm1(x)
            return x + self.attention(h, cos, sin, slots, mask, table) + \
                self.mlp(h if self.norm2 is self.norm1 else self.norm2(x))  # one shared norm: Phi-2, Cohere
        if self.post1 is not None:  # sandwich layers (Gemma 2/3)
            x = x + self.post1(self.attention(self.norm1(x), cos, sin, slots, mask, table))
            return x + self.post2(self.mlp(self.norm2(x)))
        r = self.spec.residual_scale
        if r is not None:  # Granite
            x = x + self.attention(self.norm1(x), cos, sin, slots, mask, table) * r
            return x + self.mlp(self.norm2(x)) * r
        x = x + self.attention(self.norm1(x), cos, sin, slots, mask, table)
        return x + self.mlp(self.norm2(x))


def _tables(inv_freq: torch.Tensor, scale: float, seq: int, dtype, dev,
            interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..seq-1 as transformers' rotary makes them: float32 angles pos *
    inv_freq, scaled, then cast; each angle twice, side by side for interleaved pairs."""
    pos = torch.arange(seq, device=dev, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.to(dev, torch.float32)[None, :]
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


class FastDecoder(nn.Module):
    """Not registered inside the model: its tensors are the model's own (or views of them)."""

    def __init__(self, spec: DecoderSpec, parts: Parts, fused: bool = True):
        super().__init__()
        self.spec = spec
        self.embed, self.pos_embed, self.norm = parts.embed, parts.pos_embed, parts.final_norm
        self.head = linear_of(parts.head.weight, parts.head.bias)
        # fused=False: q/k/v and gate/up side by side over the model's own weights (Side), for a decoder that is
        # only checked
        self.layers = nn.ModuleList(Layer(spec, b, i, fused) for i, b in enumerate(parts.blocks))
        self._inv_freq, self._rope_scale = parts.inv_freq, parts.attention_scaling
        self._local_inv_freq, self._local_scale = parts.local_inv_freq, parts.local_scaling
        self._long_inv_freq = parts.long_inv_freq
        # head_g: the final norm's float32 scale, folded into a quantized head (fused.fold); head_config:
        # an int4 head's folded launch shape; cos_local / sin_local: the local layers' tables (Gemma 3)
        # cos_long / sin_long: longrope's tables past spec.long_after
        for name in ("key_ok", "slot_ids", "cos", "sin", "cos_local", "sin_local", "cos_long", "sin_long",
                     "embed_mult", "head_g"):
            self.register_buffer(name, None, persistent=False)
        self.batch = self.seq = 0
        self.head_eps, self.head_config = 0.0, -1

    def setup_cache(self, batch: int, seq: int) -> None:
        """(Re)allocate the KV cache and the tables that depend on its length."""
        s, w = self.spec, getattr(self.head, "weight", None)  # an Int4Linear head has none: codes only
        dtype = w.dtype if w is not None and w.is_floating_point() else self.norm.weight.dtype
        dev = self.norm.weight.device
        for layer in self.layers:
            layer.k_cache = torch.zeros(batch, s.n_kv_heads, seq, s.head_dim, dtype=dtype, device=dev)
            layer.v_cache = torch.zeros(batch, s.n_kv_heads, seq, s.head_dim, dtype=dtype, device=dev)
        self.key_ok = torch.ones(batch, seq, dtype=torch.bool, device=dev)  # False: a padding slot
        self.slot_ids = torch.arange(seq, device=dev)
        # in the model's dtype, as transformers rounds it (Gemma: sqrt(3072) = 55.5 in bf16); a
        # buffer, not made per call: a CUDA-graph capture cannot copy a scalar from the host
        self.embed_mult = None if s.embed_scale is None else torch.tensor(s.embed_scale, dtype=dtype, device=dev)
        pairs = s.rope_pairs == "interleaved"
        if self._inv_freq is not None:
            self.cos, self.sin = _tables(self._inv_freq, self._rope_scale, seq, dtype, dev, pairs)
        if self._local_inv_freq is not None:
            self.cos_local, self.sin_local = _tables(self._local_inv_freq, self._local_scale, seq, dtype, dev, pairs)
        if self._long_inv_freq is not None:
            self.cos_long, self.sin_long = _tables(self._long_inv_freq, self._rope_scale, seq, dtype, dev, pairs)
        self.batch, self.seq = batch, seq

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                every: bool = False, last: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``tokens`` (B, T) into cache ``slots`` (T,) at ``positions`` (B, T); return the
        last position's logits (B, vocab) in float32, as transformers' generate scores them
        (``every``: all positions' logits, (B, T, vocab), for checking speculated tokens;
        ``last``: a (1,) tensor, the position whose logits to return, for a padded prompt)."""
        s = self.spec
        x = self.embed(tokens)
        if self.embed_mult is not None:
            x = x * self.embed_mult
        cos = sin = None
        if s.positions == "learned":
            x = x + F.embedding(positions + s.position_offset, self.pos_embed.weight)
        elif s.long_after is not None:
            # transformers' longrope: the long table for the whole forward once its largest position id
            # reaches the threshold (a tensor condition: no host sync, the same in a CUDA graph)
            long = positions.max() >= s.long_after
            cos = torch.where(long, self.cos_long[positions], self.cos[positions]).unsqueeze(1)
            sin = torch.where(long, self.sin_long[positions], self.sin[positions]).unsqueeze(1)
        else:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        keys = self.slot_ids[None, :]
        causal = keys <= slots[:, None]
        # a query always sees its own slot: a left-padding row, fully masked otherwise, would
        # give NaN through softmax; its output is never read, the real rows never see it
        own = (keys == slots[:, None])[None, None]
        full = windowed = (self.key_ok[:, None, None, :] & causal[None, None]) | own
        if s.sliding_window is not None:
            near = causal & (keys > slots[:, None] - s.sliding_window)
            windowed = (self.key_ok[:, None, None, :] & near[None, None]) | own
        tables = None if cos is None else {False: (cos, sin, (self.cos, self.sin, positions))}
        if s.local_rope is not None:
            tables[True] = (self.cos_local[positions].unsqueeze(1), self.sin_local[positions].unsqueeze(1),
                            (self.cos_local, self.sin_local, positions))
        for i, layer in enumerate(self.layers):
            mask = windowed if s.windowed is None or s.windowed[i] else full
            if tables is not None:
                cos, sin, table = tables[s.local_rope is not None and s.local_rope[i]]
                if s.rotary_layers is not None and not s.rotary_layers[i]:  # a NoPE layer
                    cos = sin = table = None
            x = layer(x, cos, sin, slots, mask, None if cos is None else table)
        if every:
            return self.capped(self.head(self.norm(x))).float()
        x = x[:, -1:] if last is None else x.index_select(1, last)
        if self.head_g is not None and fused.one_row(x):
            return self.capped(fused.project(x, self.head, self.head_g, self.head_eps,
                                             config=self.head_config))[:, 0].float()
        return self.capped(self.head(self.norm(x)))[:, 0].float()

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """What the model's head does after its product, in the logits' own dtype as transformers does it:
        Cohere's scale, Granite's divisor, Gemma 2's final soft cap."""
        s = self.spec
        if s.logit_scale is not None:
            logits = logits * s.logit_scale
        if s.logit_divisor is not None:
            logits = logits / s.logit_divisor
        cap = s.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
