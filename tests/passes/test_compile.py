import copy
import threading
import time

import pytest
import torch
import torch._inductor.config as inductor_config
from memory import live_tensor_bytes
from torch import nn

import torchkiln.passes.compile as compile_mod
from torchkiln.passes import compile_model


def test_matches_eager_and_leaves_global_config_alone():
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).eval()
    x = torch.randn(3, 16)
    before = inductor_config.freezing
    c = compile_model(m, {"freezing": True}, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert inductor_config.freezing == before


def _recorder(seen: list, tag=None):
    """Reads the config while the compiled call runs: dynamo runs a disabled function as is, at every call
    (a traced ``seen.append`` would read the config once, at trace time, and dynamo replays a traced
    list mutation as a whole-list write, which loses other threads' appends)."""

    @torch._dynamo.disable
    def record():
        seen.append(inductor_config.freezing if tag is None else (tag, inductor_config.freezing))

    return record


def _probe(seen: list):
    record = _recorder(seen)

    class Probe(nn.Module):
        def forward(self, x):
            record()
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


def test_the_options_hold_inside_concurrent_calls():
    """On torch < 2.13 (config process-wide) a patch per call raced here: 1 of 21 reads unpatched and the
    options left set afterwards (fourteenth session); concurrent calls now share one patch."""
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


def test_calls_with_other_options_from_other_threads_each_see_their_own():
    """Two compiled models with different options, called from several threads at once: each call sees
    its own options, and nothing stays set afterwards (on torch < 2.13 the second waits for the first)."""
    seen = {True: [], False: []}

    def probe(freeze: bool):
        record = _recorder(seen[freeze])

        class Probe(nn.Module):
            def forward(self, x):
                record()
                return x + 1

        return compile_model(Probe(), {"freezing": freeze})

    models = {True: probe(True), False: probe(False)}
    with torch.no_grad():
        for m in models.values():
            m(torch.randn(3))
        threads = [threading.Thread(target=lambda f=f: [models[f](torch.randn(3)) for _ in range(20)])
                   for f in (True, False, True, False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(seen[True]) == len(seen[False]) == 41
    assert all(seen[True]) and not any(seen[False])
    assert inductor_config.freezing is False


def test_a_compiled_call_inside_another_keeps_each_ones_options():
    seen = []
    inner_rec, outer_rec, after_rec = (_recorder(seen, tag) for tag in ("inner", "outer", "outer after"))

    class Inner(nn.Module):
        def forward(self, x):
            inner_rec()
            return x * 2

    inner = compile_model(Inner(), {"freezing": False})

    @torch._dynamo.disable
    def call_inner(x):  # the inner compiled model called at run time, as a served candidate is
        return inner(x)

    class Outer(nn.Module):
        def forward(self, x):
            outer_rec()
            y = call_inner(x)
            after_rec()
            return y

    outer = compile_model(Outer(), {"freezing": True})
    with torch.no_grad():
        outer(torch.randn(3))
    assert seen[-3:] == [("outer", True), ("inner", False), ("outer after", True)]
    assert inductor_config.freezing is False


# ------------------------------------------------ the deadline on compiling for new inputs
needs_thread_patches = pytest.mark.skipif(not compile_mod.patches_per_thread(),
                                          reason="the deadline needs per-thread inductor config patches (torch >= 2.13)")


def _slow_at_new_shapes(c, seconds: float, seen: list):
    """``c``'s compiled callable, made to take ``seconds`` at every batch size after the first (a
    pathological recompile), recording the thread and modes each call ran under."""
    class Slow(nn.Module):
        def __init__(self, real):
            super().__init__()
            self.real, self.sizes = real, []

        def forward(self, x):
            seen.append((threading.current_thread().name, torch.is_grad_enabled(),
                         torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            if self.sizes and x.shape[0] not in self.sizes:
                time.sleep(seconds)
            self.sizes.append(x.shape[0])
            return self.real(x)
    c.compiled = Slow(c.compiled)


@pytest.fixture
def short_deadlines(monkeypatch):
    monkeypatch.setattr(compile_mod, "RECOMPILE_MIN_S", 0.3)
    monkeypatch.setattr(compile_mod, "RECOMPILE_FACTOR", 0.0)
    yield
    for t in list(compile_mod._overdue):  # leave no overdue compile to the next test
        t.join()


@needs_thread_patches
def test_a_compile_past_its_deadline_raises_and_the_rest_fail_fast_until_it_ends(short_deadlines):
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    c, other = compile_model(m, {}), compile_model(copy.deepcopy(m), {})
    seen = []
    _slow_at_new_shapes(c, 1.5, seen)
    with torch.no_grad():
        torch.testing.assert_close(c(torch.ones(2, 8)), m(torch.ones(2, 8)))  # the first call: no deadline hit
        t0 = time.perf_counter()
        with pytest.raises(compile_mod.CompileTimeout, match="ran past 0.3 s"):
            c(torch.ones(3, 8))
        assert time.perf_counter() - t0 < 1.2  # returned at the deadline, not after the 1.5-s compile
        with pytest.raises(compile_mod.CompileTimeout, match="another compile ran past its deadline"):
            other(torch.ones(2, 8))  # would wait on dynamo's compile lock: fails at once
        torch.testing.assert_close(c(torch.ones(2, 8)), m(torch.ones(2, 8)))  # a signature it ran still answers
        for t in list(compile_mod._overdue):
            t.join()
        torch.testing.assert_close(other(torch.ones(2, 8)), m(torch.ones(2, 8)))  # over: compiles again
    assert [s[0] for s in seen[:2]] == ["torchkiln-compile"] * 2  # first calls ran in the worker


@needs_thread_patches
def test_the_worker_runs_under_the_callers_modes_and_raises_its_errors_in_the_caller(short_deadlines):
    m = nn.Sequential(nn.Linear(8, 8)).eval()
    c = compile_model(m, {})
    seen = []
    _slow_at_new_shapes(c, 0.0, seen)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        c(torch.ones(2, 8))
    assert seen[-1] == ("torchkiln-compile", False, True, torch.bfloat16)
    with torch.no_grad():
        c(torch.ones(2, 8))  # a signature seen: in the caller's thread
        assert seen[-1][0] == threading.current_thread().name
        with pytest.raises(RuntimeError, match="same reduction dim|cannot be multiplied") as e:
            c(torch.ones(2, 5))  # the model's own error, from the worker, raised here
        assert not isinstance(e.value, compile_mod.CompileTimeout)
    c(torch.ones(4, 8))  # grad enabled (training): always in the caller's thread
    assert seen[-1][:2] == (threading.current_thread().name, True)
