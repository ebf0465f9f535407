"""passes/full_mask.py: an SDPA mask that masks nothing is dropped from the captured graph, and only then."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchkiln as tk
from torchkiln.passes import full_mask
from torchkiln.passes.sdpa_math import SDPA


class Attention(nn.Module):
    """transformers 5.17's BERT while traced: a (batch, 1, seq, seq) mask built from aranges."""

    def __init__(self, kind: str, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.kind, self.dropout = nn.Linear(16, 48), kind, dropout

    def mask(self, x, pad):
        b, s = x.shape[:2]
        idx = torch.arange(s, device=x.device)
        if self.kind == "all":
            return (idx[None, None, :, None] >= 0).expand(b, -1, s, s)
        if self.kind == "additive":
            return torch.zeros(1, 1, s, s, device=x.device)
        if self.kind == "causal":  # masks something: stays
            return idx[None, None, :, None] >= idx[None, None, None, :]
        if self.kind == "wide":  # attends everywhere but broadcasts the batch wider than the query's
            return torch.ones(b + 1, 1, s, s, dtype=torch.bool, device=x.device)
        if self.kind == "random":  # not a function of its arguments: never evaluated
            return torch.rand(1, 1, s, s, device=x.device) >= 0
        return pad[:, None, None, :].bool().expand(b, 1, s, s)  # from the data: stays

    def forward(self, x, pad):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.kind == "wide":
            q, k, v = q[:1], k[:1], v[:1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(x, pad),
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.sum(1)


def captured(model, *args):
    """The model compiled with the pass in front of plain execution; returns (outputs, masks left, dropped)."""
    graphs = []

    def backend(gm, example_inputs):
        n = full_mask.rewrite(gm.graph)
        gm.recompile()
        graphs.append((gm, n))
        return gm.forward

    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend=backend)(*args)
    except RuntimeError as e:  # as eager raises it (a mask wider than the scores)
        out = e
    (gm, n), = graphs
    masks = [nd.kwargs.get("attn_mask") for nd in gm.graph.nodes if nd.op == "call_function" and nd.target in SDPA]
    return out, masks, n


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 6, 16, generator=g), torch.ones(2, 6)


@pytest.mark.parametrize("kind", ["all", "additive"])
def test_a_mask_that_masks_nothing_is_dropped_and_the_answer_stays(kind):
    model = Attention(kind).eval()
    x, pad = data()
    out, masks, n = captured(model, x, pad)
    assert n == 1 and masks == [None]
    torch.testing.assert_close(out, model(x, pad), rtol=1e-5, atol=1e-6)  # eager, mask given


@pytest.mark.parametrize("kind", ["causal", "wide", "random", "data"])
def test_a_mask_that_masks_something_or_cannot_be_known_stays(kind):
    model = Attention(kind).eval()
    x, pad = data()
    out, masks, n = captured(model, x, pad)
    assert n == 0 and masks[0] is not None
    if kind == "wide":  # dropped, the call would have answered where eager raises
        with pytest.raises(RuntimeError, match="broadcast"):
            model(x, pad)
        assert "broadcast" in str(out)
    elif kind != "random":
        torch.testing.assert_close(out, model(x, pad), rtol=1e-5, atol=1e-6)


def test_the_training_step_drops_it_and_says_so():
    from torch._inductor import config

    # a cached graph skips the pass, and its count (torch 2.6 has no autograd_cache)
    fresh = {k: False for k in ("fx_graph_cache", "autograd_cache") if hasattr(config, k)}
    model = Attention("all", dropout=0.1).train()
    x, pad = data()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    assert "full_mask" in [p["pass"] for p in fast.kiln_report.recipe["passes"]]
    with config.patch(fresh):
        fast(x, pad).sum().backward()
    compiled = next(m for m in fast.kiln_report.candidates if m.kind == "torchkiln")
    assert compiled.status in ("served", "passed"), compiled.reason  # the guard compared it with eager's mask
    pass_ = fast._graph_pass.passes[0] if hasattr(fast._graph_pass, "passes") else fast._graph_pass
    assert isinstance(pass_, full_mask.FullMaskPass) and pass_.fused >= 1
    assert any(a.startswith("full_mask") for a in fast.kiln_report.applied) == (compiled.status == "served")


def test_where_torch_drops_the_pass_option_the_step_runs_under_a_patch_that_holds_it(monkeypatch):
    # torch 2.6 drops pre_grad_custom_pass from torch.compile(options=...) silently: no graph pass ran
    from torch._inductor import config

    from torchkiln.training import module

    monkeypatch.setattr(module, "_custom_pass_option_kept", lambda: False)
    fresh = {k: False for k in ("fx_graph_cache", "autograd_cache") if hasattr(config, k)}
    model = Attention("all", dropout=0.1).train()
    x, pad = data()
    fast, opt = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), time_budget=0)
    assert isinstance(fast._compiled, module._Patched)
    before = config.pre_grad_custom_pass  # not None where torchao's pt2e passes were imported: it sets its own
    with config.patch(fresh):
        fast(x, pad).sum().backward()
    pass_ = fast._graph_pass.passes[0] if hasattr(fast._graph_pass, "passes") else fast._graph_pass
    assert pass_.fused >= 1 and config.pre_grad_custom_pass is before  # ran, and the patch is gone after


def test_a_mask_too_large_to_evaluate_at_compile_time_stays(monkeypatch):
    monkeypatch.setattr(full_mask, "_MAX_ELEMENTS", 2 * 6 * 6 - 1)  # the test mask is 2 x 1 x 6 x 6
    evaluated = []
    monkeypatch.setattr(full_mask, "_evaluate", lambda *a: evaluated.append(a))  # nothing computed for it
    model = Attention("all").eval()
    x, pad = data()
    out, masks, n = captured(model, x, pad)
    assert n == 0 and masks[0] is not None and not evaluated
    torch.testing.assert_close(out, model(x, pad), rtol=1e-5, atol=1e-6)
