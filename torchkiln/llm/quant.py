"""Weight-only quantization of the fast decoder's Linears.

int8 is hand-written (gpt-fast's form): int8 weights with one scale per output channel,
dequantized inside the matmul expression, for the compiler to fuse the cast into the
batch-1 GEMV. torchao's Int8WeightOnlyConfig (0.18, on torch 2.11) ran Llama-3-8B decode
at 136 tok/s on the H200, below bf16's 185. This form reached bf16's speed (201 vs 199
decode tok/s), not the 2x a 1-byte read allows: the fused int8 reduction ran at 1.5 TB/s
(benchmarks/RESULTS.md, LLM decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# int4 kernel: "auto" is torchao's tinygemm on CUDA and Int4Linear elsewhere. On the H200,
# Llama-3-8B decode: tinygemm 179 tok/s, Int4Linear 66 (the compiler did not fuse the
# unpack into the GEMV there); tinygemm has no CPU kernel for fp32 models.
INT4_IMPL = "auto"
INT4_GROUPS = (128, 64, 32)  # the first that divides a layer's input width


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight.to(x.dtype)) * self.scales
        return out + self.bias if self.bias is not None else out


class Int4Linear(nn.Module):
    """Asymmetric int4 weights in groups (128 by default) along the input, two per byte, unpacked
    and scaled inside the matmul expression like Int8Linear. The CPU int4 path (tinygemm, the
    CUDA one, has no CPU kernel for fp32 models). On CUDA it was measured against tinygemm and
    lost (see INT4_IMPL)."""

    def __init__(self, linear: nn.Linear, group: int = 128):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        g = w.view(n, k // group, group)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
        self.register_buffer("packed", q[:, 0::2] | (q[:, 1::2] << 4))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.register_buffer("zero", lo.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, half = self.packed.shape
        q = torch.stack((self.packed & 0xF, self.packed >> 4), dim=-1).view(n, -1, self.group)
        w = (q.to(x.dtype) * self.scale[..., None] + self.zero[..., None]).view(n, 2 * half)
        out = F.linear(x, w)
        return out + self.bias if self.bias is not None else out


def quantize(decoder: nn.Module, quant: str, device: torch.device) -> int:
    """Replace the decoder's layer Linears; returns how many. The output head stays in floating
    point: quantized, the compiler kept it an external GEMM whose dequantized weight copy cost
    1.26 ms per token (21% of the int8 step) on the H200 profile."""
    impl = INT4_IMPL if INT4_IMPL != "auto" else ("torchao" if device.type == "cuda" else "expression")
    if quant == "int4" and impl == "torchao":
        from ..quantization.config import QuantConfig
        from ..quantization.schemes import torchao, torchao_config

        config = torchao_config(QuantConfig("int4-weight-only"), device)
        torchao().quantize_(decoder.layers, config, filter_fn=lambda m, name: isinstance(m, nn.Linear))
        return sum(isinstance(m, nn.Linear) for m in decoder.layers.modules())
    done = 0
    for m in list(decoder.layers.modules()):
        for name, child in list(m.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if quant == "int8":
                setattr(m, name, Int8Linear(child))
            else:
                group = next((g for g in INT4_GROUPS if child.in_features % g == 0), None)
                if group is None:
                    continue  # counted out: the report shows fewer quantized layers
                setattr(m, name, Int4Linear(child, group))
            done += 1
    return done
