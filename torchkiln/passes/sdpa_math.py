"""Route F.scaled_dot_product_attention to the plain math form where that is
measured faster on this machine, for the shapes this model uses.

Why hand-written: on CPU, torch's flash-attention kernel parallelises over
batch x heads only; at short sequences (bert-base, batch 1, seq 128: 12 work
items on 2 cores) two oneDNN batched GEMMs and a softmax were measured 2x
faster (173 vs 351 us per layer in bf16: benchmarks/micro.py in RESULTS.md).
torch has no switch for this, and
inductor lowers SDPA straight to the flash kernel. So a TorchFunctionMode, entered
by the runner (no global patching), swaps SDPA calls for an opaque custom op;
dynamo traces the mode, inductor calls the op as an extern kernel.

Choices are made per (q/k/v shapes, dtype, causal, gqa) key by timing both forms on
the real inputs of a calibration call; a shape never calibrated keeps SDPA. The
mask is not part of the key: it adds about as much to either form (a few
percent of SDPA's time in an ad-hoc check), and models such as transformers'
drop an all-ones mask in eager but keep it while being traced.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..timing import median_seconds


@torch.library.custom_op("torchkiln::sdpa_math", mutates_args=())
def sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
              is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    if enable_gqa and k.size(-3) != q.size(-3):
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    # Opaque to the compiler, so it may look at data: an all-pass mask (which
    # traced models keep) costs a full pass over the scores for nothing.
    if attn_mask is not None and bool(attn_mask.all() if attn_mask.dtype == torch.bool else not attn_mask.any()):
        attn_mask = None
    # Scaling q (L x E) is cheaper than scaling the scores (L x S), and gives a
    # contiguous operand for the batched GEMM.
    q = q * (scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    s = torch.matmul(q, k.transpose(-2, -1))
    if is_causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    # torch's CPU/CUDA softmax accumulates low-precision inputs in fp32 already.
    return torch.matmul(torch.softmax(s, -1), v)


@sdpa_math.register_fake
def _(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _unpack(args, kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
    return bound


def _key(b) -> tuple | None:
    q, k, v = b["query"], b["key"], b["value"]
    if b["dropout_p"] or q.device.type != "cpu":
        return None
    try:
        shapes = tuple(tuple(int(d) for d in t.shape) for t in (q, k, v))
    except TypeError:  # symbolic (dynamic) shapes: no measured choice applies
        return None
    return shapes, str(q.dtype), bool(b["is_causal"]), bool(b["enable_gqa"])


class SDPARouter(TorchFunctionMode):
    """Enter around a model call. ``calibrating=True`` measures unseen shapes on real inputs."""

    def __init__(self):
        super().__init__()
        self.choices: dict[tuple, bool] = {}  # key -> use math
        self.timings: dict[tuple, tuple[float, float]] = {}
        self.calibrating = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        b = _unpack(args, kwargs)
        key = _key(b)
        if key is not None and self.calibrating and key not in self.choices:
            self._measure(key, b)
        if key is not None and self.choices.get(key):
            return torch.ops.torchkiln.sdpa_math(b["query"], b["key"], b["value"], b["attn_mask"],
                                                b["is_causal"], b["scale"], b["enable_gqa"])
        return func(*args, **kwargs)

    def _measure(self, key, b) -> None:
        q, k, v, m = b["query"], b["key"], b["value"], b["attn_mask"]
        with torch.no_grad():
            t_sdpa = median_seconds(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=m, is_causal=b["is_causal"], scale=b["scale"],
                **({"enable_gqa": True} if b["enable_gqa"] else {})))
            t_math = median_seconds(lambda: sdpa_math(q, k, v, m, b["is_causal"], b["scale"], b["enable_gqa"]))
        self.timings[key] = (t_sdpa, t_math)
        self.choices[key] = t_math < 0.9 * t_sdpa  # a clear win only

    def summary(self) -> str:
        used = sum(self.choices.values())
        parts = [f"{1e6 * s:.0f} vs {1e6 * m:.0f} us" for s, m in self.timings.values()]
        return f"math attention for {used}/{len(self.choices)} shapes (sdpa vs math: {', '.join(parts)})"
