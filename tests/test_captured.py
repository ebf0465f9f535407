"""Hand-captured CUDA graphs around a compiled model (torchkiln/captured.py). CUDA only: skipped
without a GPU (CI); run on the H200 whenever GPU code changes (docs/gpu.md)."""

import threading

import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln import captured as cap
from torchkiln import zoo
from torchkiln.passes import compile_model

pytestmark = pytest.mark.cuda


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x, scale: float = 1.0, extra=None):
        y = self.b(torch.relu(self.a(x))) * scale
        return {"y": y, "sum": y.sum(-1)} if extra is None else (y, extra)


def _pair():
    torch.manual_seed(0)
    net = Net().cuda().eval()
    return net, cap.Captured(compile_model(net, {}, private=True), torch.device("cuda:0"))


@torch.no_grad()
def test_replays_answer_as_the_model_does_and_are_copies():
    net, c = _pair()
    xs = [torch.randn(4, 32, device="cuda") for _ in range(3)]
    outs = [c(x) for x in xs]  # one graph, captured at the first call, replayed after
    assert len(c._graphs) == 1 and c._graphs[next(iter(c._graphs))] is not None
    for x, out in zip(xs, outs, strict=True):  # each answer kept its values after later replays
        ref = net(x)
        torch.testing.assert_close(out["y"], ref["y"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["sum"], ref["sum"], rtol=1e-5, atol=1e-5)
    graph_out = c._graphs[next(iter(c._graphs))].out["y"]
    assert all(o["y"].data_ptr() != graph_out.data_ptr() for o in outs)
    # another batch and another plain value are other signatures, each with its graph
    x8 = torch.randn(8, 32, device="cuda")
    torch.testing.assert_close(c(x8, 2.0)["y"], net(x8, 2.0)["y"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c(x8, 3.0)["y"], net(x8, 3.0)["y"], rtol=1e-5, atol=1e-5)
    assert len(c._graphs) == 3


@torch.no_grad()
def test_inputs_it_cannot_copy_in_run_without_a_graph(recwarn):
    net, c = _pair()
    x = torch.randn(4, 32, device="cuda")
    y, extra = c(x, 1.0, [1, 2])  # a list: a graph would bake its value in
    torch.testing.assert_close(y, net(x)["y"], rtol=1e-5, atol=1e-5)
    assert extra == [1, 2] and list(c._graphs.values()) == [None]
    assert "a list argument" in c.notes[0]
    with torch.enable_grad():  # grad mode: the caller serves such calls elsewhere, but never baked in
        assert c(torch.randn(2, 32, device="cuda"))["y"].shape == (2, 8)
    assert "grad mode is on" in c.notes[1]


@torch.no_grad()
def test_a_model_that_writes_into_its_inputs_gets_no_graph_and_writes_once():
    """Replays would write into the static copies, not the caller's tensor."""
    class Writes(nn.Linear):
        def forward(self, x):
            x.add_(1.0)
            return super().forward(x)

    torch.manual_seed(0)
    net = Writes(8, 8).cuda().eval()
    c = cap.Captured(compile_model(net, {}, private=True), torch.device("cuda:0"))
    x = torch.zeros(4, 8, device="cuda")
    y = c(x)
    assert torch.equal(x, torch.ones_like(x))  # written once, as eager writes it
    ones = torch.ones(4, 8, device="cuda")
    torch.testing.assert_close(y, ones @ net.weight.T + net.bias, rtol=1e-5, atol=1e-5)
    c(x)  # no graph: the compiled model writes the caller's tensor again
    assert torch.equal(x, torch.full_like(x, 2.0)) and list(c._graphs.values()) == [None]
    assert "writes into its inputs" in c.notes[0]


@torch.no_grad()
def test_signatures_past_the_limit_run_without_a_graph(monkeypatch):
    monkeypatch.setattr(cap, "MAX_GRAPHS", 2)
    net, c = _pair()
    for n in (1, 2, 3, 3):
        x = torch.randn(n, 32, device="cuda")
        torch.testing.assert_close(c(x)["y"], net(x)["y"], rtol=1e-5, atol=1e-5)
    assert len(c._graphs) == 2 and all(g is not None for g in c._graphs.values())


@torch.no_grad()
def test_calls_from_threads_on_their_own_streams_get_their_own_answers():
    net, c = _pair()
    xs = [torch.randn(64, 32, device="cuda") for _ in range(8)]
    refs = [net(x)["y"] for x in xs]
    c(xs[0])
    got, errors = [None] * len(xs), []

    def work(i):
        try:
            with torch.cuda.stream(torch.cuda.Stream()), torch.no_grad():
                for _ in range(20):
                    got[i] = c(xs[i])["y"]
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for y, ref in zip(got, refs, strict=True):
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_optimize_times_the_captured_candidate_and_its_answers_pass_the_guard():
    model, x = zoo.load("bert-base", batch=2)  # an HF encoder: input_ids and an all-ones mask
    model = model.cuda().eval()
    x = {k: v.cuda() for k, v in x.items()}
    with torch.no_grad():
        ref = model(**x).last_hidden_state
    o = tk.optimize(model, dtype=torch.bfloat16, sample_input=x)
    rep = tk.report(o)
    by = {c.name: c for c in rep.candidates}
    mine = by["torchkiln compiled (bfloat16) + captured CUDA graphs"]
    assert mine.status in ("served", "passed") and mine.median_ms is not None, str(rep)
    trees = by["torchkiln compiled (bfloat16) + CUDA graphs"]  # their compile saved: the captured graphs serve
    assert trees.status == "skipped" and "captured CUDA graphs serve" in trees.reason and trees.build_seconds is None
    with torch.no_grad():
        a = o(**x).last_hidden_state
        b = o(**x).last_hidden_state
    assert a.data_ptr() != b.data_ptr()  # copies, whichever form serves
    assert ((a.float() - ref).norm() / ref.norm()).item() <= rep.tolerance
    torch.testing.assert_close(a, b)


def test_the_graph_trees_are_built_where_nothing_was_captured():
    class TakesAList(nn.Linear):  # a list argument: the captured candidate copies only tensors and plain values in
        def forward(self, xs):
            return super().forward(xs[0])

    torch.manual_seed(0)
    model = TakesAList(16, 16).cuda().eval()
    x = [torch.zeros(4, 16, device="cuda")]
    o = tk.optimize(model, sample_input=(x,), time_budget=0)
    by = {c.name: c for c in tk.report(o).candidates}
    trees = by["torchkiln compiled (float32) + CUDA graphs"]
    assert trees.status != "skipped" and trees.build_seconds is not None, str(tk.report(o))


def test_a_model_writing_into_its_input_keeps_the_write_on_cuda():
    # (this model once showed the graph trees being built: now only candidates that run it on the caller's
    # own tensors compete, so the write reaches the caller as eager's does)
    class Writes(nn.Linear):
        def forward(self, x):
            x.add_(1.0)
            return super().forward(x)

    torch.manual_seed(0)
    model = Writes(16, 16).cuda().eval()
    o = tk.optimize(model, sample_input=torch.zeros(4, 16, device="cuda"), time_budget=0)
    x = torch.zeros(4, 16, device="cuda")
    with torch.no_grad():
        o(x)
    assert torch.equal(x, torch.ones_like(x)), str(tk.report(o))
    assert any("writes into its inputs" in f.reason for f in tk.report(o).fallbacks)
