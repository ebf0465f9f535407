"""CUDA paths. Skipped without a GPU (CI); run on the H200 whenever GPU code changes:
see docs/gpu.md."""

import copy

import pytest
import torch
from threads import assert_threads_match_serial
from torch import nn

import torchkiln as tk
from torchkiln import zoo

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _trees_built(monkeypatch):
    # these tests exercise inductor's graph trees, which optimize builds only where the hand-captured
    # graphs cannot serve (candidates._trees_needless); test_captured.py covers that choice
    from torchkiln import candidates

    monkeypatch.setattr(candidates, "TREES_BESIDE_CAPTURED", True)


def test_detect_reports_the_gpu():
    hw = tk.detect()
    acc = hw.accelerator("cuda:0")
    assert acc is not None and acc.usable and acc.name
    assert acc.memory_bytes > 2**30 and acc.capability and acc.bf16 is not None
    assert tk.default_device() == "cuda:0"
    props = torch.cuda.get_device_properties(0)  # cross-check against torch directly
    assert acc.capability == f"{props.major}.{props.minor}" and acc.memory_bytes == props.total_memory


@pytest.mark.parametrize("name,batch", [("mlp", 8), ("resnet50", 2)])
def test_optimize_bf16_on_gpu_matches_fp32_eager(name, batch):
    model, x = zoo.load(name, batch=batch)
    model = model.cuda()
    x = x.cuda()
    ref = model(x)
    o = tk.optimize(model, dtype=torch.bfloat16, sample_input=x)
    r, rep = o.kiln_recipe, o.kiln_report
    assert r.device == "cuda:0" and r.dtype == "bfloat16" and r.attention == "opaque" and r.gemm == "aten"
    by = {c.name: c for c in rep.candidates}
    assert by["torchkiln compiled (bfloat16) + CUDA graphs"].status in ("served", "passed"), str(rep)
    assert by["compile bf16-cast reduce-overhead"].median_ms is not None, str(rep)  # the stock CUDA-graph peer
    assert rep.guard["ok"]
    if rep.dtype_served == "float32":  # the model as given won (a tiny MLP is launch-bound): timed fastest
        assert name == "mlp" and rep.active == "eager (as given, float32)", str(rep)
        assert by[rep.active].median_ms == min(c.median_ms for c in rep.candidates if c.median_ms is not None)
    else:
        assert rep.dtype_served == "bfloat16", str(rep)
    y = o(x)
    assert y.dtype == torch.float32 and y.device.type == "cuda"
    assert ((y - ref).norm() / ref.norm()).item() <= rep.tolerance
    if name == "resnet50":
        assert r.memory_format == "channels_last"
        # the RGB stem padded to 8 input channels in the build, the caller's weight as it was
        assert "pad_conv_channels" in r.pass_names and model.conv1.weight.shape == (64, 3, 7, 7)
        if rep.active.startswith("torchkiln"):
            assert "pad_conv_channels (conv1 3->8 input channels)" in rep.applied, str(rep)
    assert [id(p) for p in o.parameters()] == [id(p) for p in model.parameters()]
    assert o.to("cuda") is o and o.cuda() is o


def test_cpu_model_optimized_for_cuda_keeps_cpu_checkpoint():
    model, x = zoo.load("mlp", batch=4)
    o = tk.optimize(model, device="cuda", sample_input=x)
    assert o.kiln_recipe.device == "cuda:0"
    assert all(v.device.type == "cpu" for v in o.state_dict().values())
    torch.testing.assert_close(o(x.cuda()).cpu(), model(x), rtol=1e-3, atol=1e-3)


def test_check_compares_device_with_cpu():
    model, x = zoo.load("mlp", batch=4)
    r = tk.check(model.cuda(), x.cuda(), dtype=torch.bfloat16)
    names = [row.name for row in r.rows]
    assert "cuda vs cpu" in names and r.ok, str(r)


def test_bench_reports_gpu_memory():
    model, x = zoo.load("mlp", batch=16)
    res = tk.bench(model.cuda(), x.cuda(), dtype=torch.bfloat16, peers=["compile bf16-cast", "torchkiln"], iters=5,
                   warmup=2, rounds=1, progress=False)
    assert [r.name for r in res.rows] == ["eager", "compile bf16-cast", "torchkiln"]
    assert all(r.peak_mem_mb is not None and r.peak_mem_mb >= 0 for r in res.rows)
    assert res.rows[-1].rel_err < 5e-2


def test_bf16_unsupported_gpu_keeps_fp32(monkeypatch):
    import importlib
    from dataclasses import replace

    opt_mod = importlib.import_module("torchkiln.optimize")
    importlib.import_module("torchkiln._log")._warned.clear()
    hw = tk.detect()
    old = replace(hw, accelerators=tuple(replace(a, bf16=False, capability="7.0") for a in hw.accelerators))
    monkeypatch.setattr(opt_mod, "detect", lambda: old)
    with pytest.warns(UserWarning, match="does not run it natively"):
        o = tk.optimize(nn.Linear(8, 8).cuda().eval(), dtype=torch.bfloat16, graph_mode=False)
    assert o.kiln_recipe.dtype == "float32"


def test_cuda_graph_outputs_survive_later_calls_and_threads():
    model, _ = zoo.load("mlp", batch=8)
    model = model.cuda()
    xs = [torch.randn(8, 256, device="cuda") for _ in range(8)]
    o = tk.optimize(model, sample_input=xs[0], candidates="torchkiln", time_budget=0)
    by = {c.name: c for c in o.kiln_report.candidates}
    assert o.kiln_recipe.cuda_graphs and by["torchkiln compiled (float32) + CUDA graphs"].status in ("served", "passed")
    o._install("torchkiln compiled (float32) + CUDA graphs",  # serve the graphs, whichever timed faster
               o._find("torchkiln compiled (float32) + CUDA graphs").make(), o._order)
    # Replays reuse one memory pool: earlier outputs must stay intact, and threads must agree.
    outs = assert_threads_match_serial(o, xs, repeats=3)
    for x, y in zip(xs, outs, strict=True):
        torch.testing.assert_close(y, model(x), rtol=1e-3, atol=1e-3)


def test_backward_through_a_cuda_graph_call_made_with_grad_on():
    """Grad mode on: the replay's outputs carry a backward that recomputes with the original, so the
    parameters get eager's gradients (reference: a deep copy run eagerly)."""
    model, _ = zoo.load("mlp", batch=8)
    model = model.cuda()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 256, device="cuda")
    o = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0)
    o._install("torchkiln compiled (float32) + CUDA graphs", o._find("torchkiln compiled (float32) + CUDA graphs").make(),
               o._order)
    o(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)


def test_a_cuda_graph_served_model_in_training_mode_and_under_vmap_runs_the_original():
    """train() (a parent's) and torch.func transforms reach the original before any replay: dropout
    draws as eager's, vmap gives eager's result; .eval() serves the graphs again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 4)).cuda().eval()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 64, device="cuda")
    o = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0)
    name = "torchkiln compiled (float32) + CUDA graphs"
    o._install(name, o._find(name).make(), o._order)
    with torch.no_grad():
        o(x)
        o.train()
        torch.manual_seed(3)
        a = o(x)
        torch.manual_seed(3)
        torch.testing.assert_close(a, ref.train()(x))
        o.eval()
        ref.eval()
        torch.testing.assert_close(torch.vmap(o)(x[:, None]), torch.vmap(ref)(x[:, None]))
        torch.testing.assert_close(o(x), ref(x), rtol=1e-3, atol=1e-3)
    assert o.kiln_report.active == name and o._own is None


def test_a_cuda_graph_served_bf16_model_under_autocast_or_inference_mode_replays_its_graphs():
    """IPEX's recipe (optimize at bf16, call under autocast): the graphs replay with the caller's autocast
    off inside, no new compile, the answer of the call outside autocast; autocast at float16 runs the
    original under it."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 4)).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    o = tk.optimize(model, dtype=torch.bfloat16, sample_input=x, candidates="torchkiln", time_budget=0)
    name = "torchkiln compiled (bfloat16) + CUDA graphs"
    o._install(name, o._find(name).make(), o._order)
    with torch.no_grad():
        outside = o(x).clone()
        graphs = counters["stats"]["unique_graphs"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            inside = o(x).clone()
        with torch.inference_mode():  # dispatch keys differ there: served out of it, no new graph
            in_mode = o(x.clone()).clone()
        assert counters["stats"]["unique_graphs"] == graphs
        torch.testing.assert_close(inside, outside, rtol=0, atol=0)
        torch.testing.assert_close(in_mode, outside, rtol=0, atol=0)
        with torch.autocast("cuda", dtype=torch.float16):
            half = o(x)
            want = model(x)
        assert half.dtype == torch.float16 and torch.equal(half, want)
    assert o.kiln_report.active == name


def test_cuda_graph_outputs_in_a_dataclass_survive_later_calls():
    """A model's own output dataclass was a pytree leaf: its tensors were not copied out of the graph
    pool, so the next replay overwrote the previous answer."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor

    class Wrap(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return Out(self.net(x))

    net, _ = zoo.load("mlp", batch=8)
    model = Wrap(net).cuda().eval()
    xs = [torch.randn(8, 256, device="cuda") for _ in range(3)]
    o = tk.optimize(model, sample_input=xs[0], candidates="torchkiln", time_budget=0)
    o._install("torchkiln compiled (float32) + CUDA graphs", o._find("torchkiln compiled (float32) + CUDA graphs").make(),
               o._order)
    outs = [o(x) for x in xs]
    for x, y in zip(xs, outs, strict=True):
        assert type(y) is Out
        torch.testing.assert_close(y.logits, model(x).logits, rtol=1e-3, atol=1e-3)


def test_served_cuda_graph_calls_keep_the_per_call_checks_quick_and_hooks_fire():
    """The hook check reads every module's dicts only when RemovableHandle's id counter moves, and
    the weight check skips its lookups while no dict's version tag moves: replays must move neither.
    A hook registered after optimize then fires, through the original."""
    from torch.utils.hooks import RemovableHandle

    model, _ = zoo.load("mlp", batch=8)
    model = model.cuda()
    x = torch.randn(8, 256, device="cuda")
    o = tk.optimize(model, sample_input=x, candidates="torchkiln", time_budget=0)
    name = "torchkiln compiled (float32) + CUDA graphs"
    with torch.no_grad():
        o(x)
        o._install(name, o._find(name).make(), o._order)
        o._remember_weights()
        for _ in range(3):
            o(x)
        counter, w = RemovableHandle.next_id, o._watch
        c, tags = w._seen[4], w._seen[6]
        for _ in range(5):
            o(x)
        assert RemovableHandle.next_id == counter
        if tags is not None:
            assert c.tags(w._tag_dicts) == tags
        seen = []
        handle = model[2].register_forward_hook(lambda m, i, out: seen.append(out))
        with pytest.warns(UserWarning, match="forward hooks differ"):
            out = o(x)
        handle.remove()
    assert o.kiln_report.active == name and len(seen) == 1
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)


def test_fully_masked_rows_give_zeros_on_cuda_attention_paths():
    import torch.nn.functional as F

    from torchkiln.passes.sdpa_math import attention, sdpa, sdpa_math

    q, k, v = (torch.randn(2, 4, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device="cuda")
    mask[0, :, 3] = False  # query row 3 of batch 0 sees no key
    # Key-constant masks (last stride 0, as transformers 5.17 traces) take another path.
    rows = torch.ones(2, 1, 16, 1, dtype=torch.bool, device="cuda")
    rows[0, :, 3] = False
    for fn, m in ((sdpa, mask), (sdpa_math, mask), (sdpa, rows.expand(2, 1, 16, 16))):
        out = attention(q, k, v, m, False, None, False, fn)
        assert torch.isfinite(out).all() and out[0, :, 3].abs().max() == 0, fn
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        ok = mask.any(-1, keepdim=True).expand_as(ref[..., :1])
        assert ((out.double() - ref).abs() * ok).max() < 3e-2


@pytest.mark.parametrize("padded", [False, True])
def test_hf_encoder_keeps_fast_attention_under_compile(padded):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                                  attn_implementation="sdpa")
    model = transformers.BertModel(cfg).cuda().eval()
    ids = torch.randint(0, cfg.vocab_size, (4, 64), device="cuda")
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 40:] = 0
    o = tk.optimize(model, dtype=torch.bfloat16, sample_input={"input_ids": ids, "attention_mask": mask},
                    candidates="torchkiln", time_budget=0)
    with torch.profiler.profile() as prof:
        out = o(input_ids=ids, attention_mask=mask)
    names = " ".join(e.key for e in prof.key_averages())
    assert "safe_softmax" not in names
    assert "flash" in names.lower() or "efficient" in names.lower() or "cudnn" in names.lower(), names[:2000]
    ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    err = (out.last_hidden_state - ref)[keep].norm() / ref[keep].norm()
    assert err < o.kiln_report.tolerance


def test_gelu_epilogue_on_cuda_is_within_half_precision_rounding():
    """cuBLASLt's bias+GELU epilogue (tanh form) against the exact GELU in float64: no further from it
    than the unfused bf16 computation, give or take a little."""
    from torchkiln.passes.gelu_epilogue import linear_gelu

    torch.manual_seed(0)
    x, w, b = torch.randn(4, 128, 768, device="cuda"), torch.randn(3072, 768, device="cuda") / 28, \
        torch.randn(3072, device="cuda") / 10
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), w.double(), b.double()))
    lo = [t.bfloat16() for t in (x, w, b)]
    fused = linear_gelu(*lo, "none")
    plain = torch.nn.functional.gelu(torch.nn.functional.linear(*lo))

    def rel(t):
        return float((t.double() - ref).norm() / ref.norm())

    assert fused.dtype == torch.bfloat16 and fused.shape == ref.shape
    assert rel(fused) <= 1.5 * rel(plain) + 1e-3, (rel(fused), rel(plain))


def test_hf_encoder_runs_its_ffn_gelu_in_the_gemm_epilogue():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                                  attn_implementation="sdpa")
    model = transformers.BertModel(cfg).cuda().eval()
    ids = torch.randint(0, cfg.vocab_size, (4, 64), device="cuda")
    o = tk.optimize(model, dtype=torch.bfloat16, candidates="torchkiln", time_budget=0)
    assert "gelu_epilogue" in o.kiln_recipe.pass_names
    o(input_ids=ids)  # chooses and verifies (no sample: no CUDA graphs, so the profile shows the ops)
    with torch.profiler.profile() as prof:
        out = o(input_ids=ids)
    assert sum(e.count for e in prof.key_averages() if "linear_gelu" in e.key) >= 2, o.kiln_report
    ref = model(input_ids=ids).last_hidden_state
    assert float((out.last_hidden_state - ref).norm() / ref.norm()) < o.kiln_report.tolerance


def test_training_pair_on_cuda_fused_compiled_and_matching_stock():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10)).cuda().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    fast, opt2 = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, sample_input=x, time_budget=0.5)
    assert opt2 is opt and opt.param_groups[0]["fused"]
    assert fast.kiln_recipe.precision == "autocast" and fast.kiln_report.guard["ok"]
    for m, o, ac in ((fast, opt, False), (ref, ref_opt, True)):
        for _ in range(5):
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac):
                loss = nn.functional.cross_entropy(m(x).float(), y)
            loss.backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


def test_split_master_weights_on_cuda_follow_fused_adamw_exactly():
    # Reference: torch's fused AdamW on float32 copies fed the split model's own (bf16) gradients.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10)).cuda().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, sample_input=x, time_budget=0.5,
                            split_master_weight_for_bf16=True)
    assert fast.kiln_recipe.master_weights == "split" and fast.kiln_report.guard["ok"]
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight.is_cuda
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(fast(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    sd = fast.state_dict()
    for (k, v), q in zip(sd.items(), ref.parameters(), strict=True):
        assert v.dtype == torch.float32, k
        torch.testing.assert_close(v, q.detach(), rtol=0, atol=0)
