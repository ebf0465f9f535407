"""tk.llm on CUDA: the compiled decode step with CUDA graphs against transformers' greedy
generate (fp32), bf16, and weight-only int8/int4 through torchao."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import torchkiln as tk  # noqa: E402

from .families import build  # noqa: E402

pytestmark = pytest.mark.cuda
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "opt"])
def test_cuda_graph_decode_matches_hf_fp32(family):
    model = build(family).cuda()
    fast = tk.llm.optimize(model, dtype=torch.float32)
    assert fast.kiln_report.cudagraphs and fast.kiln_report.path == "fast"
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    for n in (12, 5):  # a second call reuses the graphs
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=n, **GREEDY)
        assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=n, **GREEDY))
    assert len(fast.kiln_report.compile_s) == 1


def test_auto_dtype_is_bf16_and_tokens_mostly_agree():
    model = build("llama", seed=2).cuda()
    fast = tk.llm.optimize(model)
    assert fast.kiln_report.dtype == "bfloat16"
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(3)).cuda()
    got = fast.generate(ids, max_new_tokens=16, **GREEDY)
    ref = model.to(torch.bfloat16).generate(ids, max_new_tokens=16, **GREEDY)
    assert got.shape == ref.shape and int((got != ref).sum()) <= 4  # bf16 kernels may flip a near-tie


@pytest.mark.parametrize("quant,cos", [("int8", 0.999), ("int4", 0.95)])
def test_weight_only_quant_on_cuda(quant, cos):
    pytest.importorskip("torchao")
    model = build("llama", seed=4).cuda()
    fast = tk.llm.optimize(model, dtype=torch.bfloat16, quant=quant, max_seq_len=64)
    assert fast.kiln_report.path == "fast" and fast.kiln_report.quant_cosine >= cos, fast.kiln_report
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(5)).cuda()
    out = fast.generate(ids, max_new_tokens=8, **GREEDY)
    assert out.shape == (1, 16)
