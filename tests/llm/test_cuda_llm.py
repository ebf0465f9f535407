"""tk.llm on CUDA: the compiled decode step with CUDA graphs against transformers' greedy
generate (fp32), bf16, and weight-only int8/int4 through the Triton GEMVs (quantization/gemv.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import torchkiln as tk  # noqa: E402

from .families import build, longrope  # noqa: E402

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


@pytest.mark.parametrize("family,sizes,windowed", [
    ("mistral", dict(sliding_window=6), None),
    # each layer's own mask (transformers' layer_types: Qwen2's max_window_layers)
    ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), [False, True])])
def test_a_sliding_window_shorter_than_the_request_through_the_decode_kernel_matches_hf(family, sizes, windowed):
    # the decode-attention kernel takes FastDecoder's mask, which carries the window; left padding too
    model = build(family, seed=5, **sizes).cuda()
    fast = tk.llm.optimize(model, dtype=torch.float32)
    assert fast.kiln_report.attention == "kernel" and fast.kiln_report.path == "fast"
    got_windowed = fast.kiln_report.spec["windowed"]
    assert (got_windowed if got_windowed is None else list(got_windowed)) == windowed
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(6)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=16, **GREEDY)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=16, **GREEDY))


def test_a_module_replaced_after_optimize_is_decoded_on_cuda():
    model = build("llama", seed=46).cuda()
    fast = tk.llm.optimize(model, dtype=torch.float32)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(47)).cuda()
    fast.generate(ids, max_new_tokens=4, **GREEDY)
    torch.manual_seed(48)
    down = torch.nn.Linear(96, 64, bias=False).cuda()
    down.weight.data.mul_(20)
    fast.model.layers[0].mlp.down_proj = down
    ref = build("llama", seed=46).cuda()
    ref.model.layers[0].mlp.down_proj = down
    assert torch.equal(fast.generate(ids, max_new_tokens=8, **GREEDY), ref.generate(ids, max_new_tokens=8, **GREEDY))


def test_a_quantized_decoder_follows_new_weights_on_cuda():
    model, other = build("llama", seed=7).cuda(), build("llama", seed=8).cuda()
    fast = tk.llm.optimize(model, dtype=torch.bfloat16, quant="int8", max_seq_len=64)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(9)).cuda()
    fast.generate(ids, max_new_tokens=8, **GREEDY)
    fast.load_state_dict(other.state_dict())
    want = tk.llm.optimize(other, dtype=torch.bfloat16, quant="int8", max_seq_len=64)
    assert torch.equal(fast.generate(ids, max_new_tokens=8, **GREEDY), want.generate(ids, max_new_tokens=8, **GREEDY))


def test_stop_tokens_read_one_token_late_match_hf():
    """On CUDA generate reads "every row stopped" a token late (generate.StopCheck): the same
    tokens as transformers, rows stopping at different steps."""
    model = build("llama").cuda()
    fast = tk.llm.optimize(model, dtype=torch.float32)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1)).cuda()
    free = model.generate(ids, max_new_tokens=12, **GREEDY)
    stops = [int(free[0, 7 + 3]), int(free[1, 7 + 6])]
    for eos, n in ((stops[0], 12), (stops, 12), (stops, 4), (1, 12)):
        kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=eos)
        assert torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw)), (eos, n)


@pytest.mark.parametrize("family,sizes,length", [
    # soft caps (grouped attention on every width), four norms a layer
    ("gemma2", dict(attn_logit_softcapping=0.05, final_logit_softcapping=3.0, sliding_window=6,
                    attn_implementation="eager"), 5),
    ("gemma3", dict(sliding_window=6), 5),  # a rotary table per layer type, through the decode kernel
    # longrope: a prompt past the switch, and a padded one whose positions pass it during decode (the
    # table chosen on the GPU inside the CUDA graphs)
    ("phi3", longrope([3.0 + 0.5 * i for i in range(8)]), 14),
    ("phi3", longrope([3.0 + 0.5 * i for i in range(8)]), 13)])
def test_gemma2_gemma3_and_longrope_decoders_match_hf_on_cuda(family, sizes, length):
    model = build(family, seed=7, **sizes).cuda()
    fast = tk.llm.optimize(model, dtype=torch.float32)
    assert fast.kiln_report.path == "fast" and fast.kiln_report.cudagraphs, fast.kiln_report.reason
    ids = torch.randint(3, 96, (2, length), generator=torch.Generator().manual_seed(8)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    if length == 13:
        mask[:, :3] = 0
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=10, **GREEDY)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=10, **GREEDY))
    assert not fast.kiln_report.fallbacks


@pytest.mark.parametrize("cls_name,fields", [
    ("Helium", dict(head_dim=16)), ("SmolLM3", dict(no_rope_layer_interval=4)),
    ("Phi", dict(partial_rotary_factor=0.5)), ("Cohere", dict(logit_scale=0.5)), ("Olmo2", dict()),
    ("Granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05,
                     logits_scaling=8.0))])
def test_decoders_beyond_the_issue_families_match_hf_on_cuda(cls_name, fields):
    from .test_generate import _family

    model = _family(cls_name, **fields).cuda()
    fast = tk.llm.optimize(model, dtype=torch.float32)
    assert fast.kiln_report.path == "fast" and fast.kiln_report.cudagraphs, fast.kiln_report.reason
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(11)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=10, **GREEDY)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=10, **GREEDY))


def test_a_sandwich_decoder_is_quantized_unfolded_on_cuda():
    # Gemma 3's norms after attention and the MLP are not among the neighbours the int8 GEMVs fold
    model = build("gemma3", seed=9).cuda()
    fast = tk.llm.optimize(model, dtype=torch.bfloat16, quant="int8", max_seq_len=64)
    rep = fast.kiln_report
    assert rep.path == "fast" and rep.quant_cosine >= 0.999 and not rep.folded, rep
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(10)).cuda()
    assert fast.generate(ids, max_new_tokens=8, **GREEDY).shape == (1, 16)


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
    model = build("llama", seed=4).cuda()
    fast = tk.llm.optimize(model, dtype=torch.bfloat16, quant=quant, max_seq_len=64)
    rep = fast.kiln_report
    assert rep.path == "fast" and rep.quant_cosine >= cos, rep
    assert rep.quant_layers == 2 * 4 + 1  # 2 layers x 4 Linears, and the head where a kernel serves it
    assert rep.quant_head == ("int4" if quant == "int4" else "int8")  # int4: torchkiln's CUDA kernel (INT4_HEAD)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(5)).cuda()
    out = fast.generate(ids, max_new_tokens=8, **GREEDY)
    assert out.shape == (1, 16)


@pytest.mark.parametrize("impl", ["tinygemm", "auto"])  # tinygemm: forced
def test_int4_batched_decode_each_row_decodes_as_alone_up_to_a_near_tie(impl, monkeypatch):
    """A batch of 8 decodes each row as it decodes alone: the same first logits within bf16 rounding,
    and the same tokens until a step whose choice was a near-tie when decoded alone (batched and
    alone prompts take different kernels: a wide prefill dequantizes for cuBLAS; after one near-tie
    flips the two sequences rightly part). Through torch's or the Triton kernels, max_batch_size at
    INT4_SLOW_ROWS warns that int4 decodes such batches slower than bf16 and says what serves them
    faster; through torchkiln's CUDA kernel ("auto" here, where nvcc builds it) 8 rows take one pass
    and it does not."""
    import warnings

    from torchkiln.llm import api, quant

    monkeypatch.setattr(quant, "INT4_IMPL", impl)
    model = build("llama", seed=6).cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = tk.llm.optimize(model, dtype=torch.bfloat16, quant="int4", max_seq_len=64,
                               max_batch_size=api.INT4_SLOW_ROWS)
    slow = [w for w in caught if "max_batch_size=8" in str(w.message)]
    # (this small model's layers are too narrow for tinygemm: forced, the Triton GEMV serves them)
    kernels = fast.kiln_report.int4_kernel
    assert ("torchkiln CUDA" in kernels) == (impl == "auto"), kernels
    if impl == "auto":  # each layer's down (96 inputs) takes groups of 32: the report says which and why
        # (of 9: the head is int4 in torchkiln's kernel too, quant.INT4_HEAD)
        assert any(f.startswith("2 of 9 int4 layers run Triton GEMV") and "groups of 64-256" in f
                   for f in fast.kiln_report.fallbacks), fast.kiln_report.fallbacks
    assert len(slow) == (impl != "auto") and (not slow or "quant='int8'" in str(slow[0].message))
    ids = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(7)).cuda()
    kw = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True, **GREEDY)
    out = fast.generate(ids, **kw)
    assert out.sequences.shape == (8, 14)
    tie = 0.25  # 4 bf16 steps at these logits' magnitude (8-16); the first logits differ by up to 0.11
    for row in (0, 3, 7):
        one = fast.generate(ids[row:row + 1], **kw)
        torch.testing.assert_close(out.logits[0][row].float(), one.logits[0][0].float(), rtol=0, atol=tie)
        got, want = out.sequences[row, 8:], one.sequences[0, 8:]
        parted = (got != want).nonzero()
        if len(parted):
            step = int(parted[0])
            alone = one.logits[step][0].float()
            assert alone[got[step]] >= alone.max() - tie, (row, step)  # the batch's choice was a near-tie alone


def _dequantized(q) -> torch.Tensor:
    """The float weight of an Int8Linear/Int4Linear, written without its forward or the kernels."""
    from torchkiln.quantization.weight_only import Int8Linear

    if isinstance(q, Int8Linear):
        return q.weight.float() * q.scales.float()[:, None]
    n, half_k = q.packed.shape
    cols = []
    for g in range(2 * half_k // q.group):  # per group: low nibbles, then high nibbles
        p = q.packed[:, g * q.group // 2:(g + 1) * q.group // 2].int()
        vals = torch.cat((p % 16, p // 16), dim=1).float()
        cols.append(vals * q.scale[:, g:g + 1].float() + q.zero[:, g:g + 1].float())
    return torch.cat(cols, dim=1)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("n,k,rows,group", [(4096, 4096, 1, 128), (1000, 1536, 3, 128), (33, 320, 2, 64),
                                            (17, 256, 4, 32), (1000, 1536, 1, 128), (33, 320, 1, 64),
                                            (17, 192, 1, 32)])
def test_gemv_kernels_match_dequantized_weights(kind, n, k, rows, group):
    """The Triton GEMVs (eager and inside a compiled, CUDA-graphed function) against a float matmul
    over the dequantized weight; odd N and group counts exercise the masked tails, and one row with
    5 groups or 48 words a row the one-row kernels' smallest tiles."""
    from torchkiln.quantization import gemv
    from torchkiln.quantization.weight_only import Int4Linear, Int8Linear

    torch.manual_seed(n + k)
    lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    q = Int8Linear(lin) if kind == "int8" else Int4Linear(lin, group)
    x = torch.randn(rows, 1, k, device="cuda", dtype=torch.bfloat16)
    assert gemv.usable(x, k)
    ref = x.float() @ _dequantized(q).t() + lin.bias.float()
    for got in (q(x), torch.compile(q, mode="reduce-overhead")(x)):
        assert got.shape == (rows, 1, n) and got.dtype == torch.bfloat16
        err = float((got.float() - ref).norm() / ref.norm())
        assert err < 8e-3, err  # bf16 output and scales: ~4e-3
    wide = torch.randn(2 * gemv.MAX_ROWS, k, device="cuda", dtype=torch.bfloat16)  # prefill: the expression
    assert not gemv.usable(wide, k)
    err = float((q(wide).float() - (wide.float() @ _dequantized(q).t() + lin.bias.float())).norm())
    assert err / float((wide.float() @ _dequantized(q).t()).norm()) < 8e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [5, 37, 256, 300])
@pytest.mark.parametrize("n,k", [(1000, 1536), (70, 4096)])
def test_int8_prefill_rows_match_dequantized_weights(dtype, rows, n, k):
    """Int8Linear's calls wider than the GEMVs: the int8 matmul kernel (16-bit x, up to
    gemv.WIDE_ROWS rows) or the expression, against a float64 matmul over the dequantized weight."""
    from torchkiln.quantization import gemv
    from torchkiln.quantization.weight_only import Int8Linear

    torch.manual_seed(rows + n)
    lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=dtype)
    q = Int8Linear(lin)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    assert gemv.wide(x, k) == (rows <= gemv.WIDE_ROWS and dtype != torch.float32)
    w = q.weight.double() * q.scales.double()[:, None]
    ref = x.double() @ w.t() + lin.bias.double()
    got = q(x)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert float((got.double() - ref).norm() / ref.norm()) < (1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("mode", ["words", "bytes"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (33, 320, 64), (17, 192, 32), (70, 14336, 128)])
def test_one_row_kernels_both_forms(mode, kind, n, k, group, monkeypatch):
    """Each one-row kernel (gemv.ONE_ROW picks by size when "auto", so force each) against a float
    matmul over the dequantized weight."""
    from torchkiln.quantization import gemv
    from torchkiln.quantization.weight_only import Int4Linear, Int8Linear

    monkeypatch.setattr(gemv, "ONE_ROW", mode)
    torch.manual_seed(n * k)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    q = Int8Linear(lin) if kind == "int8" else Int4Linear(lin, group)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ _dequantized(q).t()
    err = float((q(x).float() - ref).norm() / ref.norm())
    assert err < 8e-3, err


@pytest.mark.parametrize("n,k,rows,group", [(4096, 4096, 1, 128), (1024, 1536, 3, 64), (256, 512, 16, 32),
                                            (256, 512, 48, 32), (1024, 1536, 96, 128)])
def test_tinygemm_layout_matches_the_triton_layout(n, k, rows, group):
    """Int4Linear in tinygemm's layout (torch's int4 kernel on plain buffers; dequantized for cuBLAS
    above TINYGEMM_ROWS rows) against a float matmul over the Triton layout's dequantized weight: the
    same q, scale and zero, packed another way."""
    from torchkiln.quantization import gemv
    from torchkiln.quantization.weight_only import TINYGEMM_ROWS, Int4Linear

    torch.manual_seed(n + rows)
    lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    assert Int4Linear.fits_tinygemm(lin, group)
    tiny, plain = Int4Linear(lin, group, tinygemm=True), Int4Linear(lin, group)
    x = torch.randn(rows, 1, k, device="cuda", dtype=torch.bfloat16)
    want = _dequantized(plain)
    ref = x.float() @ want.t() + lin.bias.float()
    for got in (tiny(x), torch.compile(tiny, mode="reduce-overhead")(x)):
        assert got.shape == (rows, 1, n) and got.dtype == torch.bfloat16
        err = float((got.float() - ref).norm() / ref.norm())
        assert err < 8e-3, err
    if rows > TINYGEMM_ROWS:  # the unpacked tiles themselves (bf16, and the table's zero rounded to bf16)
        w = gemv.tinygemm_dense(tiny.packed, tiny.scale_zero, tiny.order, group)
        assert w.shape == (n, k) and w.dtype == torch.bfloat16
        assert float((w.float() - want).abs().max()) < 1e-2 * float(want.abs().max())
    assert not Int4Linear.fits_tinygemm(torch.nn.Linear(k, n, device="cuda"), group)  # float32: no


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [2, 4])
def test_int8_decode_rows_each_dtype(dtype, rows):
    """2-4 rows (batched decode): the int8 matmul kernel in 16-bit, the few-row GEMV in float32, each
    against a float64 matmul over the dequantized weight."""
    from torchkiln.quantization.weight_only import Int8Linear

    torch.manual_seed(rows)
    lin = torch.nn.Linear(1536, 1000, bias=True, device="cuda", dtype=dtype)
    q = Int8Linear(lin)
    x = torch.randn(rows, 1536, device="cuda", dtype=dtype)
    ref = x.double() @ (q.weight.double() * q.scales.double()[:, None]).t() + lin.bias.double()
    got = q(x)
    assert got.shape == (rows, 1000) and got.dtype == dtype
    assert float((got.double() - ref).norm() / ref.norm()) < (1e-5 if dtype == torch.float32 else 8e-3)


def test_gptq_int4_on_cuda():
    """GPTQ codes packed into the int4 kernel's layout on the GPU (bf16): the quantized logits stay close to the float
    ones on the probe prompt, and it decodes."""
    model = build("llama", seed=6).cuda()
    calib = [torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(s)).cuda() for s in (7, 8, 9)]
    g = tk.llm.optimize(model, dtype=torch.bfloat16, quant="int4", max_seq_len=64, calib_data=calib)
    assert g.kiln_report.quant_rounding == "gptq" and g.kiln_report.quant_cosine >= 0.95, g.kiln_report
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(5)).cuda()
    assert g.generate(ids, max_new_tokens=8, min_new_tokens=8, **GREEDY).shape == (1, 16)


def _prefill_both_ways(runner, ids, mask):
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    graphed = runner.prefill(ids, mask, pos)
    eager = runner.prefill(ids, mask, pos, graph=False)
    return graphed, eager


def test_prefill_graphs_match_eager_prefill_and_follow_the_cache():
    from torchkiln.llm import runner as runner_mod

    fast = tk.llm.optimize(build("llama", seed=6).cuda(), dtype=torch.float32)
    runner = fast._kiln_runner
    gen = torch.Generator().manual_seed(9)
    runner.reserve(2, 100)
    assert runner_mod.PREFILL_ROUND == 16
    for L in (5, 14, 33):  # widths 16, 16, 48: two graphs
        ids = torch.randint(3, 96, (2, L), generator=gen).cuda()
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        graphed, eager = _prefill_both_ways(runner, ids, mask)
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert sorted(key[0] for key in runner._graphs) == [16, 48]
    runner.reserve(1, 40)  # a new cache (one row): the graphs wrote into the old one
    assert not runner._graphs
    graphed, eager = _prefill_both_ways(runner, ids[1:], mask[1:])
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert list(runner._graphs) == [(48, 1, runner.decoder.seq)]


def test_a_failed_prefill_capture_prefills_eagerly(monkeypatch):
    fast = tk.llm.optimize(build("llama", seed=6).cuda(), dtype=torch.float32)
    runner = fast._kiln_runner
    runner.reserve(1, 20)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(10)).cuda()

    class Broken:
        def __init__(self):
            raise RuntimeError("capture refused")

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "CUDAGraph", Broken)
        with pytest.warns(UserWarning, match="capturing the prefill failed"):
            graphed, eager = _prefill_both_ways(runner, ids, torch.ones_like(ids))
    assert torch.equal(graphed, eager)
    assert not runner.prefill_graphs and not runner._graphs
    assert any("prefill CUDA graph -> eager: capture refused" in f for f in fast.kiln_report.fallbacks)
    want = fast.generate(ids, max_new_tokens=6, **GREEDY)  # then generate works, eagerly prefilled
    assert torch.equal(want[:, :6], ids) and want.shape == (1, 12)


def test_prefill_graphs_survive_empty_cache_other_captures_and_other_models():
    """A captured prefill must not use memory something else can free: the compiled decode step's
    CUDA-graph trees drop cuBLAS's workspaces around every recording (a workspace baked into the
    prefill graph from an earlier eager call would be freed under it), torch.cuda.graph() and users
    empty the cache, other models capture. Freed memory is overwritten with NaN and released between
    the calls, so a dangling read shows in the tokens and a dangling write as a CUDA error."""
    fast = tk.llm.optimize(build("llama", seed=14, hidden_size=128, intermediate_size=256).cuda(),
                           dtype=torch.float32)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(15)).cuda()
    want = fast.generate(ids, max_new_tokens=8, **GREEDY)
    other = tk.llm.optimize(build("llama", seed=16).cuda(), dtype=torch.float32)
    other.generate(ids, max_new_tokens=4, **GREEDY)  # its own prefill capture and compiled step
    a = torch.randn(64, 64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # an unrelated capture with a cuBLAS call
        a @ a
    del g
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    junk = torch.full((int(free * 0.5) // 4,), float("nan"), device="cuda")  # reuse what was freed
    del junk
    torch.cuda.empty_cache()
    for _ in range(2):
        assert torch.equal(fast.generate(ids, max_new_tokens=8, **GREEDY), want)
    torch.cuda.synchronize()


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 1536), (96, 64)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_float_gemv_matches_a_float64_product(n, k, dtype, tol):
    from torchkiln.quantization import gemv

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to("cuda", dtype)
    x = torch.randn(1, 1, k, generator=g).to("cuda", dtype)
    assert gemv.wanted(w)
    got = gemv.float_linear(x, w)
    ref = (x.double() @ w.double().t()).float()
    assert got.shape == (1, 1, n) and got.dtype == dtype
    assert float((got.float() - ref).norm() / ref.norm()) <= tol
    rows = torch.randn(3, k, generator=g).to("cuda", dtype)  # more rows: F.linear
    torch.testing.assert_close(gemv.float_linear(rows, w), torch.nn.functional.linear(rows, w))


def test_cuda_projections_report_their_measured_choice():
    from torchkiln.llm.model import CublasLinear, TritonLinear

    cfg = dict(hidden_size=256, intermediate_size=512)
    model = build("llama", seed=11, **cfg).cuda().to(torch.bfloat16)
    fast = tk.llm.optimize(model, dtype=torch.bfloat16)
    line = fast.kiln_report.cuda_gemv
    assert line and line.startswith("out: ") and "; down: " in line, line
    layers = fast._kiln_runner.decoder.layers
    for name in ("out", "down"):
        part = line.split(f"{name}: ")[1]
        want = TritonLinear if part.startswith("triton") else CublasLinear
        assert all(type(getattr(layer, name)) is want for layer in layers), (name, line)


def test_a_failed_projection_measurement_keeps_cublas_and_says_why(monkeypatch):
    from torchkiln.llm import model as llm_model

    def broken(*a, **k):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(llm_model, "graph_times", broken)
    model = build("llama", seed=12, hidden_size=128, intermediate_size=256).cuda()
    fast = tk.llm.optimize(model, dtype=torch.float32)
    assert fast.kiln_report.cuda_gemv == ("out: cuBLAS (not measured: capture refused); "
                                          "down: cuBLAS (not measured: capture refused)")
    assert all(type(layer.out) is llm_model.CublasLinear for layer in fast._kiln_runner.decoder.layers)


def test_triton_projections_decode_as_hf_greedy_fp32(monkeypatch):
    from torchkiln.llm import model as llm_model

    monkeypatch.setattr(llm_model, "pick", lambda times, base, margin=0.9: "triton")  # whatever timed faster
    model = build("llama", seed=12, hidden_size=128, intermediate_size=256).cuda()
    fast = tk.llm.optimize(model, dtype=torch.float32)
    layers = fast._kiln_runner.decoder.layers
    assert all(type(layer.out) is llm_model.TritonLinear and type(layer.down) is llm_model.TritonLinear
               for layer in layers)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(13)).cuda()
    got = fast.generate(ids, max_new_tokens=10, **GREEDY)
    assert torch.equal(got, model.generate(ids, max_new_tokens=10, **GREEDY))
