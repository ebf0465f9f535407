"""The quantized CUDA decode step (int8, and int4 in torchkiln's CUDA kernel) with each
projection's neighbours folded into its GEMV.

In the unfused step every layer also runs an add + RMSNorm kernel before q/k/v, another before
gate/up, and silu(gate) * up before down: one-CTA reductions and tiny pointwise kernels, each a
launch and a DRAM round trip between two GEMVs. The one-row int8 kernels (quantization/gemv.py,
``int8_fused``) take them in: the norm as a prologue (the kernel already streams all of x; the
sum of squares rides along, the scalar rsqrt is applied to the dot products at the end), the
residual add and silu * up as epilogues (gate row n and up row n in the same program). So a layer
is q/k/v (+ norm, and RoPE and the cache writes where qkv_rope.py serves), the attention kernels,
o (+ residual), gate/up (+ norm, silu * up), down (+ residual).
Measured on the H200: RESULTS.md, "The neighbours folded in" (twenty-first session). torchkiln's
int4 CUDA kernel (kernels/cuda_int4.cu) takes the same neighbours: the norm as a prologue that
stages x * g in shared memory (its loop reads x per 64 columns, a multiply there would sit in the
loop), the gate and up rows of the same outputs in one block (RB 2), the residual on the store
(RESULTS.md, forty-second session).

Which norms and activations qualify is read from what the modules compute, not their class
names: a norm qualifies when it equals x * rsqrt(mean(x^2) + eps) * g on a probe for a g made
from its weight (Llama's w, Gemma's 1 + w), an activation when it equals x * sigmoid(x). Numerics:
the norm, residual and activation stay in float32 inside the kernel, where the unfused step rounds
each to the model's dtype in between, so outputs differ from the unfused int8 step by rounding
(tested: tests/llm/test_fused.py). Only the quantized path folds: its weights are already an
approximation, while the float path promises transformers' own numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cuda_int4
from ..quantization import gemv
from ..quantization.weight_only import Int4Linear, Int8Linear
from . import qkv_rope

ON = True  # fold where it qualifies (tk.llm.optimize, quant="int8" on CUDA); False for side-by-sides
# Fold int4 layers in torchkiln's CUDA kernel too: Llama-3-8B int4 decoded 471.7 tok/s against 421.9
# unfolded, its first generate 11.8 s against 31.7 s (H200, RESULTS.md, forty-third session). False: the
# unfolded step, for side-by-sides (benchmarks/diag_llm_options.py's "int4-unfolded").
INT4 = True


def project(x: torch.Tensor, lin: nn.Module, norm: torch.Tensor | None = None, eps: float = 0.0,
            gated: bool = False, resid: torch.Tensor | None = None, config: int = -1) -> torch.Tensor:
    """One row of x through a kernel-served Int8Linear or (mma layout) Int4Linear with the
    neighbours folded in (gemv.int8_fused's and cuda_int4.mm's arguments); ``config``: the int4
    kernel's launch shape (the folded forms are tuned apart: Folded)."""
    if isinstance(lin, Int8Linear):
        return gemv.int8_fused(x, lin, norm, eps, gated, resid)
    # the op by name (dynamo does not trace into folded_op()'s cache; fold() defined it), on x and the
    # residual as they are, as the int8 ops take them
    return torch.ops.torchkiln.cuda_int4_folded(x, lin.packed, lin.scale_zero, lin.group,
                                                lin.config if config < 0 else config, norm, eps, gated, lin.bias, resid)


def foldable(lin: nn.Module) -> bool:
    """Is ``lin`` one of the kernels that take the neighbours? (Whether int4 layers are folded at all
    is tk.llm's choice: INT4.)"""
    if isinstance(lin, Int8Linear):
        return lin.kernel and lin.in_features % 64 == 0
    return isinstance(lin, Int4Linear) and lin.mma


def rms_form(norm: nn.Module, hidden: int) -> tuple[torch.Tensor, float] | None:
    """(g in float32, eps) if ``norm`` computes x * rsqrt(mean(x^2) + eps) * g over the last dim,
    else None."""
    w = getattr(norm, "weight", None)
    eps = next((v for v in (getattr(norm, a, None) for a in ("variance_epsilon", "eps")) if isinstance(v, float)),
               None)
    if not isinstance(w, torch.Tensor) or w.shape != (hidden,) or eps is None \
            or getattr(norm, "bias", None) is not None:
        return None
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)).to(w.device) * 3 + 1
    with torch.no_grad():
        try:
            got = norm(x).float()
        except Exception:
            return None
        unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        for g in (w.float(), 1 + w.float()):
            if torch.allclose(got, unit * g, rtol=1e-4, atol=1e-5):
                return g.detach().clone().contiguous(), eps
    return None


def is_silu(act: nn.Module) -> bool:
    x = torch.linspace(-8, 8, 257)
    try:
        with torch.no_grad():
            return torch.allclose(act(x).float(), F.silu(x), rtol=1e-5, atol=1e-6)
    except Exception:
        return False


class Folded(nn.Module):
    """One layer's folded norms (buffers, so they follow the decoder's device); for int4, the folded
    q/k/v and gate/up kernels' own launch shapes (tuned in _warm)."""

    def __init__(self, g1: torch.Tensor, eps1: float, g2: torch.Tensor, eps2: float, gated: bool):
        super().__init__()
        self.register_buffer("g1", g1, persistent=False)
        self.register_buffer("g2", g2, persistent=False)
        self.eps1, self.eps2, self.gated = eps1, eps2, gated
        self.qkv_config = self.up_config = -1

    def forward(self, layer: nn.Module, x, cos, sin, slots, mask, table=None):
        if layer.rope_kernel and table is not None and isinstance(layer.qkv, Int8Linear):
            # RoPE and the cache writes in the q/k/v GEMV too
            q = qkv_rope.qkv_rope(x, layer.qkv, self.g1, self.eps1, *table, slots, layer.k_cache, layer.v_cache,
                                  layer.spec.n_heads)
            a = layer.look(q, mask)
        else:
            a = layer.attend(project(x, layer.qkv, self.g1, self.eps1, config=self.qkv_config), cos, sin, slots,
                             mask, table)
        x = project(a, layer.out, resid=x)
        if self.gated:
            h = project(x, layer.up, self.g2, self.eps2, gated=True, config=self.up_config)
        elif layer.spec.mlp == "gated":
            gate, up = project(x, layer.up, self.g2, self.eps2, config=self.up_config).chunk(2, dim=-1)
            h = layer.act(gate) * up
        else:
            h = layer.act(project(x, layer.up, self.g2, self.eps2, config=self.up_config))
        return project(h, layer.down, resid=x)


def one_row(x: torch.Tensor) -> bool:
    return x.shape[:-1].numel() == 1 and gemv.usable(x, x.shape[-1])


def fold(decoder: nn.Module) -> int:
    """Fold the neighbours of every layer whose projections are all CUDA int8 kernels, or all int4
    ones in torchkiln's CUDA kernel, and whose norms (and activation, to fold silu * up) qualify;
    the output head's final norm too, where the head is one of those kernels (below). Returns the number
    of layers folded."""
    spec, done = decoder.spec, 0
    for layer in decoder.layers:
        projs = [layer.qkv, layer.out, layer.up, layer.down]
        if spec.parallel_residual or spec.sandwich or spec.residual_scale is not None \
                or not all(foldable(p) for p in projs) \
                or len({type(p) for p in projs}) > 1:
            continue
        n1, n2 = rms_form(layer.norm1, spec.hidden), rms_form(layer.norm2, spec.hidden)
        if n1 is None or n2 is None:
            continue
        gated = spec.mlp == "gated" and layer.up.bias is None and is_silu(layer.act) \
            and (isinstance(layer.up, Int8Linear) or layer.up.out_features % 32 == 0)
        layer.folded = Folded(*n1, *n2, gated)
        done += 1
    head = decoder.head
    # The head's op must already be in the layers: an op first met at the step's end (an int8 head's
    # int8_gemv_fused after int4-folded layers, or an int4 head's after unfolded ones) made torch 2.11's
    # inductor format its arguments (its implicit fallback's log line, built even when not logged): the
    # last layer's output, printed with its inputs, recursively, through 4 x 32 folded ops each feeding
    # two: a compile that did not end (RESULTS.md, forty-second session; torch 2.13 formats it lazily).
    # Elsewhere the norm stays inductor's.
    int4_layers = any(layer.folded is not None and isinstance(layer.qkv, Int4Linear) for layer in decoder.layers)
    same = (isinstance(head, Int8Linear) and head.kernel and not int4_layers) or \
        (isinstance(head, Int4Linear) and head.mma and int4_layers)
    final = rms_form(decoder.norm, spec.hidden) if same else None
    if final is not None:
        decoder.head_g, decoder.head_eps = final
    _warm(decoder)
    return done


def _warm(decoder: nn.Module) -> None:
    """Tune each folded kernel (its own autotune key; the int4 kernel's launch shapes) once, outside
    any CUDA-graph capture, as gemv.warm does for the plain ones."""
    dtype = decoder.norm.weight.dtype
    with torch.no_grad():
        for layer in decoder.layers:
            f = layer.folded
            if f is None:
                continue
            if isinstance(layer.qkv, Int4Linear):
                cuda_int4.folded_op()
                dev = f.g1.device
                f.qkv_config = cuda_int4.tune(layer.qkv.out_features, layer.qkv.in_features, layer.qkv.group, dev,
                                              "norm")
                f.up_config = cuda_int4.tune(layer.up.out_features, layer.up.in_features, layer.up.group, dev,
                                             "gated" if f.gated else "norm")
                continue
            x = torch.zeros(1, layer.qkv.in_features, device=f.g1.device, dtype=dtype)
            if layer.rope_kernel:  # tuning runs the kernel once per config: scratch caches, not the layer's
                s = decoder.spec
                cache = torch.zeros(1, s.n_kv_heads, 1, s.head_dim, device=x.device, dtype=dtype)
                ones = torch.ones(1, s.head_dim, device=x.device, dtype=dtype)
                zero = torch.zeros(1, dtype=torch.long, device=x.device)
                qkv_rope.qkv_rope(x, layer.qkv, f.g1, f.eps1, ones, ones, zero.view(1, 1), zero, cache, cache.clone(),
                                  s.n_heads)
            else:
                gemv.int8_fused(x, layer.qkv, f.g1, f.eps1)
            gemv.int8_fused(torch.zeros(1, layer.out.in_features, device=x.device, dtype=dtype), layer.out, resid=x)
            h = gemv.int8_fused(x, layer.up, f.g2, f.eps2, gated=f.gated)
            gemv.int8_fused(h if f.gated else torch.zeros(1, layer.down.in_features, device=x.device, dtype=dtype),
                            layer.down, resid=x)
        head = decoder.head
        if decoder.head_g is not None and isinstance(head, Int4Linear):
            decoder.head_config = cuda_int4.tune(head.out_features, head.in_features, head.group,
                                                 decoder.head_g.device, "norm")
        elif decoder.head_g is not None:
            x = torch.zeros(1, head.in_features, device=decoder.head_g.device, dtype=dtype)
            gemv.int8_fused(x, head, decoder.head_g, decoder.head_eps)
