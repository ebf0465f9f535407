"""Does fusing conv + bias (+ residual) + ReLU into one cuDNN call pay in a compiled conv net?

Inductor has no epilogue fusion for the cuDNN convolutions it calls: bias/add/ReLU run as a
separate Triton kernel that reads and writes the activation again. cuDNN's fused kernels
(``torch.cudnn_convolution_relu`` / ``_add_relu``, what TorchScript's frozen CUDA fusion used)
apply them in the convolution's epilogue. This script rewrites relu(conv) and relu(conv + z) in
inductor's post-grad graph (after freezing folded BatchNorm) into those calls, wrapped in custom
ops with fake implementations, and times torchkiln's recipe with and without the rewrite, with and
without CUDA graphs, against stock compile (default and reduce-overhead), interleaved in one
process. Result on the H200 (RESULTS.md, 2026-11-22): 2.3-2.5x *slower*, so not in the library.

    python benchmarks/diag_conv_epilogue.py --device cuda --model resnet50 --batch 256 64
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from _variants import cases, check_and_time, print_table

from torchkiln import stock
from torchkiln.candidates import KilnBuild
from torchkiln.passes.compile import compile_model

try:  # a hashable pass keeps inductor's FX graph cache on
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # older torch: the cache is bypassed, the pass still runs
    CustomGraphPass = object  # type: ignore[misc,assignment]

aten = torch.ops.aten
# Measured only for bf16/fp16 (what the CUDA plans serve); float32 convs stay as inductor has them.
HALF = (torch.bfloat16, torch.float16)


def _layout(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) \
        and not x.is_contiguous() else torch.contiguous_format


def _conv(x, w, b, stride, padding, dilation, groups):
    return F.conv2d(x, w, b, stride, padding, dilation, groups)


@torch.library.custom_op("torchkiln::conv_bias_relu", mutates_args=())
def conv_bias_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: list[int],
                   padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    fmt = _layout(x)
    if x.is_cuda:
        out = torch.cudnn_convolution_relu(x, w.contiguous(memory_format=fmt), b, stride, padding, dilation, groups)
    else:  # the same arithmetic unfused, so the rewrite is testable without a GPU
        out = torch.relu(_conv(x, w, b, stride, padding, dilation, groups))
    return out.contiguous(memory_format=fmt)


@torch.library.custom_op("torchkiln::conv_bias_add_relu", mutates_args=())
def conv_bias_add_relu(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, b: torch.Tensor | None,
                       stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    fmt = _layout(x)
    if x.is_cuda:
        out = torch.cudnn_convolution_add_relu(x, w.contiguous(memory_format=fmt), z.contiguous(memory_format=fmt),
                                               1.0, b, stride, padding, dilation, groups)
    else:
        out = torch.relu(_conv(x, w, b, stride, padding, dilation, groups) + z)
    return out.contiguous(memory_format=fmt)


def _fake(x, w, b, stride, padding, dilation, groups):
    n, _, h, wd = x.shape
    kh, kw = w.shape[-2:]
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return x.new_empty((n, w.shape[0], oh, ow)).contiguous(memory_format=_layout(x))


conv_bias_relu.register_fake(_fake)
conv_bias_add_relu.register_fake(lambda x, w, z, b, s, p, d, g: _fake(x, w, b, s, p, d, g))


def _plain_conv(node) -> bool:
    """A 2-D, non-transposed aten.convolution in half precision whose only user is ``node``'s
    consumer (so removing its standalone output loses nothing)."""
    if node.op != "call_function" or node.target is not aten.convolution.default or len(node.users) != 1:
        return False
    _, w, _, stride, _, _, transposed, out_pad, _ = node.args
    val = node.meta.get("val")
    return (not transposed and len(stride) == 2 and not any(out_pad) and isinstance(val, torch.Tensor)
            and val.dtype in HALF and val.dim() == 4)


def fuse(graph: torch.fx.Graph) -> int:
    """Rewrites relu(conv) and relu(conv + z) in ``graph``; returns how many were fused."""
    n = 0
    for relu in list(graph.nodes):
        if relu.op != "call_function" or relu.target is not aten.relu.default:
            continue
        src = relu.args[0]
        conv, z = None, None
        if _plain_conv(src):
            conv = src
        elif (src.op == "call_function" and src.target is aten.add.Tensor and len(src.users) == 1
              and not src.kwargs and len(src.args) == 2):
            for a, other in (src.args, src.args[::-1]):
                if isinstance(a, torch.fx.Node) and _plain_conv(a) and isinstance(other, torch.fx.Node) \
                        and _same(a, other):
                    conv, z = a, other
                    break
        if conv is None:
            continue
        x, w, b, stride, padding, dilation, _, _, groups = conv.args
        with graph.inserting_before(relu):
            if z is None:
                new = graph.call_function(torch.ops.torchkiln.conv_bias_relu.default,
                                          (x, w, b, stride, padding, dilation, groups))
            else:
                new = graph.call_function(torch.ops.torchkiln.conv_bias_add_relu.default,
                                          (x, w, z, b, stride, padding, dilation, groups))
        new.meta.update(relu.meta)
        relu.replace_all_uses_with(new)
        graph.erase_node(relu)
        if src is not conv:
            graph.erase_node(src)
        graph.erase_node(conv)
        n += 1
    return n


def _same(a, b) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape \
        and va.dtype == vb.dtype and va.device == vb.device


class ConvEpiloguePass(CustomGraphPass):
    """The inductor post-grad hook; ``fused`` counts rewrites over this object's compiles."""

    def __init__(self):
        self.fused = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.fused += fuse(graph)

    def uuid(self) -> bytes:  # the FX graph cache keys compiled graphs on this pass's source
        return hashlib.sha256(Path(__file__).read_bytes()).digest()



def main():
    for a, dev, batch, model, args, kwargs, recipe in cases("resnet50", 256, 10.0):
        sample = (args, kwargs)
        opts = dict(recipe.compile_options)
        fns, passes = {}, {}
        for graphs in (False, True):
            g = {"triton.cudagraphs": graphs and dev.type == "cuda"}
            tag = " + graphs" if g["triton.cudagraphs"] else ""
            for epi in (False, True):
                o = {**opts, **g}
                if epi:
                    passes[graphs] = ConvEpiloguePass()
                    o["post_grad_custom_post_pass"] = passes[graphs]
                build = KilnBuild(model, recipe, sample, False, [])
                fns[f"kiln{' + conv epilogue' if epi else ''}{tag}"] = build.call(
                    compile_model(build.runner(), o, private=True), g["triton.cudagraphs"])
        for r in stock.compile_recipes(dev, torch.bfloat16):
            if r.how == "cast":
                fns[r.name] = stock.build(r, model, dev, cudnn_benchmark=True)
        _, times, med = check_and_time(fns, model, args, kwargs, dev, a.budget)
        print("convs fused:", {("graphs" if k else "no graphs"): p.fused for k, p in passes.items()})
        print_table(f"{a.model} bs{batch} bf16", times, med, batch)


if __name__ == "__main__":
    main()
