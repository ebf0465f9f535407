"""CUDA paths. Skipped without a GPU (CI); run on the H200 whenever GPU code changes:
see docs/gpu.md."""

import pytest
import torch
from threads import assert_threads_match_serial
from torch import nn

import torchkiln as tk
from torchkiln import zoo

pytestmark = pytest.mark.cuda


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
    r = o.kiln_recipe
    assert r.device == "cuda:0" and r.dtype == "bfloat16" and r.attention == "sdpa" and r.gemm == "aten"
    assert o.kiln_report.active == "compiled full graph (bfloat16)", o.kiln_report
    y = o(x)
    assert y.dtype == torch.float32 and y.device.type == "cuda"
    assert ((y - ref).norm() / ref.norm()).item() < 5e-2
    if name == "resnet50":
        assert r.memory_format == "channels_last"
    assert list(o.state_dict()) == list(model.state_dict())


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
    assert all(r.peak_mem_mb and r.peak_mem_mb > 0 for r in res.rows)
    assert res.rows[-1].rel_err < 5e-2


def test_bf16_unsupported_gpu_keeps_fp32(monkeypatch):
    import importlib
    from dataclasses import replace

    opt_mod = importlib.import_module("torchkiln.optimize")
    hw = tk.detect()
    old = replace(hw, accelerators=tuple(replace(a, bf16=False, capability="7.0") for a in hw.accelerators))
    monkeypatch.setattr(opt_mod, "detect", lambda: old)
    with pytest.warns(UserWarning, match="does not run it natively"):
        o = tk.optimize(nn.Linear(8, 8).cuda(), dtype=torch.bfloat16, graph_mode=False)
    assert o.kiln_recipe.dtype == "float32"


def test_cuda_graph_outputs_survive_later_calls_and_threads():
    model, _ = zoo.load("mlp", batch=8)
    model = model.cuda()
    xs = [torch.randn(8, 256, device="cuda") for _ in range(8)]
    o = tk.optimize(model, sample_input=xs[0])
    assert o.kiln_recipe.cuda_graphs and o.kiln_report.active.startswith("compiled")
    # Replays reuse one memory pool: earlier outputs must stay intact, and threads must agree.
    outs = assert_threads_match_serial(o, xs, repeats=3)
    for x, y in zip(xs, outs, strict=True):
        torch.testing.assert_close(y, model(x), rtol=1e-3, atol=1e-3)
