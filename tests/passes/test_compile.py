import threading

import pytest
import torch
import torch._inductor.config as inductor_config
from memory import live_tensor_bytes
from torch import nn

from torchkiln.passes import compile_model
from torchkiln.passes.compile import patches_per_thread


def test_matches_eager_and_leaves_global_config_alone():
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).eval()
    x = torch.randn(3, 16)
    before = inductor_config.freezing
    c = compile_model(m, {"freezing": True}, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert inductor_config.freezing == before


def _probe(seen: list):
    class Probe(nn.Module):  # reads the config while the compiled call runs (at a graph break)
        def forward(self, x):
            torch._dynamo.graph_break()
            seen.append(inductor_config.freezing)
            return x * 2

    return compile_model(Probe(), {"freezing": True})


def test_the_options_hold_inside_every_call_and_nowhere_else():
    seen = []
    c = _probe(seen)
    with torch.no_grad():
        for _ in range(3):  # the kept patch (Compiled._patch) is re-entered: it must apply each time
            c(torch.randn(3))
            assert inductor_config.freezing is False
    assert seen == [True, True, True]


@pytest.mark.skipif(not patches_per_thread(), reason=f"torch {torch.__version__}'s config patches are process-wide: a thread "
                    "leaving its patch ends another's (a known race on torch < 2.13, benchmarks/RESULTS.md)")
def test_the_options_hold_inside_concurrent_calls():
    seen = []
    c = _probe(seen)
    xs = [torch.randn(3) for _ in range(4)]
    with torch.no_grad():
        c(xs[0])
        threads = [threading.Thread(target=lambda x=x: [c(x) for _ in range(5)]) for x in xs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(seen) == 21 and all(seen)
    assert inductor_config.freezing is False


def test_a_dropped_compiled_model_frees_its_graphs_and_frozen_weights():
    # Before the fix, dynamo's __compiled_fn_* globals and inductor's output modules (which hold
    # frozen weights as constants) outlived the model: each compile kept a copy of the weights.
    import torchkiln.passes.compile as pc

    weights = 4 * 1024 * 1024  # 16 MB of float32 weights: far above the noise of small tensors
    x = torch.randn(2, 1024)
    before = live_tensor_bytes()
    for opts in ({}, {"freezing": True}):
        m = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024)).eval()
        c = compile_model(m, opts, fullgraph=True, private=True)
        with torch.no_grad():
            ref = m(x)
            torch.testing.assert_close(c(x), ref, rtol=1e-5, atol=1e-5)
        assert live_tensor_bytes() - before >= weights  # alive while referenced (the measure can see it)
        del m, c, ref
    assert live_tensor_bytes() - before < weights // 16
    assert not [k for k in vars(pc) if k.startswith("__compiled_fn")]
