"""The CUDA decode step's one-query attention kernel (torchkiln/llm/decode_attention.py) against
SDPA over the repeated KV heads, and how tk.llm routes to it; the right-padded prefill that the
CUDA-graph prefill relies on, checked on the CPU against the unpadded one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchkiln.llm import decode_attention

pytest.importorskip("transformers")

import torchkiln as tk  # noqa: E402

from .families import build  # noqa: E402

needs_kernel = pytest.mark.skipif(not decode_attention.available(), reason="needs CUDA and Triton")


def _case(B, H, KV, S, D, dtype, slot, pad, device="cuda"):
    g = torch.Generator().manual_seed(B * 1000 + S)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float32).to(device, dtype)
               for shape in ((B, H, 1, D), (B, KV, S, D), (B, KV, S, D)))
    keys = torch.arange(S, device=device)
    slots = torch.tensor(slot, device=device)
    mask = keys[None] <= slots[:, None]
    for row, n in enumerate(pad):  # left padding
        mask[row, :n] = False
    mask = (mask | (keys[None] == slots[:, None]))[:, None, None, :]
    return q, k, v, mask


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("B,H,KV,S,D,slot,pad", [
    (1, 32, 8, 256, 128, [40], [0]),          # Llama-3-8B's heads; all but the first chunk masked
    (1, 32, 8, 256, 128, [255], [0]),         # the whole cache
    (2, 4, 2, 300, 96, [299, 7], [3, 5]),     # head_dim not a power of two, padding, ragged cache
    (3, 6, 6, 70, 64, [1, 30, 69], [0, 0, 2]),  # no grouping; a row that sees 2 slots
    (1, 8, 1, 2000, 64, [1999], [0]),         # more blocks than MAX_SPLITS: chunks of several blocks
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_sdpa(B, H, KV, S, D, slot, pad, dtype, tol):
    q, k, v, mask = _case(B, H, KV, S, D, dtype, slot, pad)
    scale = 1 / math.sqrt(D)
    assert decode_attention.wanted(q.device)  # registers the op
    got = decode_attention.attend(q, k, v, mask, scale)
    rep = H // KV
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                         v.float().repeat_interleave(rep, 1), attn_mask=mask, scale=scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert (got.float() - ref).abs().max().item() <= tol


@pytest.mark.cuda
@needs_kernel
def test_kernel_under_compile_and_a_broadcast_mask():
    q, k, v, mask = _case(2, 8, 2, 128, 64, torch.bfloat16, [127, 127], [0, 0])
    decode_attention.wanted(q.device)
    fn = torch.compile(lambda q, k, v, m: decode_attention.attend(q, k, v, m, 0.125), fullgraph=True)
    got = fn(q, k, v, mask[:1])  # one mask row for the batch
    ref = decode_attention.attend(q, k, v, mask[:1].expand(2, -1, -1, -1).contiguous(), 0.125)
    assert torch.equal(got, ref)


@pytest.mark.cuda
@needs_kernel
def test_llm_routes_cuda_decode_to_the_kernel():
    fast = tk.llm.optimize(build("llama").cuda(), dtype=torch.float32)
    assert fast.kiln_report.attention == "kernel"
    assert all(layer.decode_kernel for layer in fast._kiln_runner.decoder.layers)
    assert "decode attention: kernel" in str(fast.kiln_report)


def test_cpu_decode_attends_by_matmul():
    fast = tk.llm.optimize(build("llama"), dtype=torch.float32, compile=False)
    assert fast.kiln_report.attention == "matmul"
    assert not any(layer.decode_kernel for layer in fast._kiln_runner.decoder.layers)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "opt"])
def test_right_padded_prefill_then_decode_matches_unpadded(family):
    """What the CUDA prefill graph does (tokens padded on the right to a fixed width, the logits
    read at the last real position) gives the unpadded prefill's logits, and the decode steps after
    it see none of the padding's keys."""
    fast = tk.llm.optimize(build(family, seed=7), dtype=torch.float32, compile=False)
    runner = fast._kiln_runner
    d = runner.decoder
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    runs = []
    for width in (5, 32):
        runner.reserve(2, 40)
        d.key_ok.fill_(True)
        d.key_ok[:, :5] = mask.bool()
        tokens = torch.zeros(2, width, dtype=torch.long)
        tokens[:, :5] = ids
        positions = torch.zeros_like(tokens)
        positions[:, :5] = pos
        with torch.no_grad():
            out = [d(tokens, torch.arange(width), positions, last=torch.tensor([4]))]
            nxt, slot, p = out[0].argmax(-1), torch.tensor([5]), pos[:, -1:] + 1
            for _ in range(3):
                out.append(d(nxt[:, None], slot, p))
                nxt, slot, p = out[-1].argmax(-1), slot + 1, p + 1
        runs.append(torch.stack(out))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@needs_kernel
def test_long_caches_stay_with_sdpa():
    q = torch.zeros(1, 4, 1, 64, device="cuda")
    near = torch.zeros(1, 2, decode_attention.MAX_SLOTS, 64, device="cuda")
    far = torch.zeros(1, 2, decode_attention.MAX_SLOTS + 256, 64, device="cuda")
    assert decode_attention.usable(q, near) and not decode_attention.usable(q, far)
    assert not decode_attention.usable(torch.zeros(1, 4, 2, 64, device="cuda"), near)  # two queries
