"""quantization/concat_linear_fx.py: sibling linears of an exported graph merged into one, checked
against the model run as written (float), against the same model quantized without the merge
(int8: the merge must not change one output bit), and the cases left alone."""

from __future__ import annotations

import needs
import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.quantization import pt2e_flow
from torchkiln.quantization.concat_linear_fx import LINEAR, concat_sibling_linears


class Attn(nn.Module):
    """q, k, v read one input (v twice as wide); gate reads it too but has no bias (not merged with
    biased ones); out reads another input."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.gate = nn.Linear(d, d, bias=False)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.norm(x)
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1) @ self.v(h)
        return self.out(a) * torch.sigmoid(self.gate(h)) + x


def linears(gm) -> int:
    return sum(n.op == "call_function" and n.target is LINEAR for n in gm.graph.nodes)


def exported(model, x):
    return torch.export.export(model, (x,), strict=False).module()


def test_merges_siblings_and_keeps_the_result():
    torch.manual_seed(0)
    model, x = Attn().eval(), torch.randn(2, 8, 32)
    gm = exported(model, x)
    assert linears(gm) == 5
    merged = concat_sibling_linears(gm)
    assert merged == 2 and linears(gm) == 3  # q, k, v -> one; gate (no bias) and out alone
    names = [n for n, _ in gm.named_parameters()] + [n for n, _ in gm.named_buffers()]
    assert not any(n.startswith(("q.", "k.", "v.")) for n in names), names  # their weights dropped
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gm(torch.randn(2, 8, 32)).shape, torch.Size([2, 8, 32]))
    assert model.q.weight.shape == (32, 32)  # the caller's model untouched


@pytest.mark.parametrize("keep", [("k",), ("q",), ("q", "v"), ()])
def test_a_kept_linear_stays_its_own(keep):
    """A linear kept in floating point stays a linear of its own name (the quantizer's
    set_module_name_qconfig finds it); the rest of its group still merges."""
    torch.manual_seed(0)
    model, x = Attn().eval(), torch.randn(2, 8, 32)
    gm = exported(model, x)
    merged = concat_sibling_linears(gm, keep)
    assert merged == max(0, 3 - len(keep) - 1)
    own = {n.meta["nn_module_stack"][next(reversed(n.meta["nn_module_stack"]))][0]
           for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR}
    assert set(keep) <= own
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


@needs.pt2e
def test_int8_static_is_bit_identical_with_and_without_the_merge(monkeypatch):
    """The claim in the module's docstring: one input observer, per-channel weights, int32 sums."""
    torch.manual_seed(0)
    model = Attn().eval()
    calib = [torch.randn(2, 8, 32) for _ in range(4)]
    x = torch.randn(2, 8, 32)
    merged = tk.quantize(model, "int8-static", calib_data=calib, auto_fallback=False)
    seen = []
    real = pt2e_flow.concat_sibling_linears
    monkeypatch.setattr(pt2e_flow, "concat_sibling_linears", lambda g, keep=(): seen.append(real(g, keep)) or 0)
    plain = tk.quantize(model, "int8-static", calib_data=calib, auto_fallback=False)
    monkeypatch.setattr(pt2e_flow, "concat_sibling_linears", lambda g, keep=(): 0)
    unmerged = tk.quantize(model, "int8-static", calib_data=calib, auto_fallback=False)
    assert seen == [2]
    with torch.no_grad():
        a, b, c = merged(x), plain(x), unmerged(x)
    assert torch.equal(a, b)
    assert torch.equal(a, c)
    assert (a - model(x)).abs().max() > 0  # quantized, not float


@needs.pt2e
def test_save_load_with_the_merge_and_a_file_from_before_it(tmp_path, monkeypatch):
    """A saved calibration names the observers of the graph it was made on: files written before the
    merge existed (no "merged_linears" in the manifest) must load without merging, newer ones with."""
    import json

    torch.manual_seed(0)
    model = Attn().eval()
    calib = [torch.randn(2, 8, 32) for _ in range(4)]
    x = torch.randn(2, 8, 32)
    q = tk.quantize(model, "int8-static", calib_data=calib, auto_fallback=False, progress=False)
    tk.quantization.save(q, tmp_path / "new.pt", float_model=model)
    with torch.no_grad():
        torch.testing.assert_close(tk.quantization.load(model, tmp_path / "new.pt")(x), q(x), rtol=0, atol=0)

    monkeypatch.setattr(pt2e_flow, "concat_sibling_linears", lambda g, keep=(): 0)
    old = tk.quantize(model, "int8-static", calib_data=calib, auto_fallback=False, progress=False)
    tk.quantization.save(old, tmp_path / "old.pt", float_model=model)
    monkeypatch.undo()
    blob = torch.load(tmp_path / "old.pt", weights_only=True)
    manifest = json.loads(blob["manifest"])
    del manifest["merged_linears"]
    blob["manifest"] = json.dumps(manifest)
    torch.save(blob, tmp_path / "old.pt")
    loaded = tk.quantization.load(model, tmp_path / "old.pt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), old(x), rtol=0, atol=0)
