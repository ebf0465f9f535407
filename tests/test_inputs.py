"""inputs.clone (the copy a CUDA-graph output gets on every call) against torch's pytree walk; call signatures."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from torchkiln import inputs

Pair = namedtuple("Pair", "a b")


def _outputs():
    t = [torch.randn(2, 3) for _ in range(4)]
    yield t[0]
    yield (t[0], [t[1], {"x": t[2], "n": 3}], None)
    yield Pair(t[0], (t[1], "s"))
    transformers = pytest.importorskip("transformers")
    cls = transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions
    yield cls(last_hidden_state=t[0], pooler_output=t[1], hidden_states=(t[2], t[3]))


def _same_but_copied(got, want, orig):
    assert type(got) is type(want)
    g, gs = pytree.tree_flatten(got)
    w, ws = pytree.tree_flatten(want)
    o, _ = pytree.tree_flatten(orig)
    assert gs == ws
    for a, b, c in zip(g, w, o, strict=True):
        if isinstance(c, torch.Tensor):
            assert torch.equal(a, b) and a.data_ptr() != c.data_ptr()
        else:
            assert a == b


@pytest.mark.parametrize("case", range(4))
def test_clone_matches_pytree_and_copies_every_tensor(case):
    out = list(_outputs())[case]
    _same_but_copied(inputs.clone(out), pytree.tree_map_only(torch.Tensor, torch.clone, out), out)


def test_a_cloned_model_output_reads_the_same_every_way_and_owns_its_tensors():
    transformers = pytest.importorskip("transformers")
    cls = transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions
    h, p, s = torch.randn(1, 4, 8), torch.randn(1, 8), torch.randn(1, 4, 8)
    out = cls(last_hidden_state=h, pooler_output=p, hidden_states=(s,))
    c = inputs.clone(out)
    assert list(c.keys()) == ["last_hidden_state", "pooler_output", "hidden_states"]
    assert c.attentions is None and c.cross_attentions is None
    assert c[0] is c.last_hidden_state is c["last_hidden_state"] and c.to_tuple()[1] is c.pooler_output
    h.add_(1), p.add_(1), s.add_(1)  # the graph pool's next replay, overwriting the originals
    torch.testing.assert_close(c.last_hidden_state + 1, h, rtol=0, atol=0)
    torch.testing.assert_close(c.hidden_states[0] + 1, s, rtol=0, atol=0)
    c.pooler_output = torch.zeros(1, 8)  # still a ModelOutput: an attribute write updates the item
    assert torch.equal(c["pooler_output"], torch.zeros(1, 8))


@pytest.mark.parametrize("sample,rows", [
    (((torch.randint(0, 9, (4, 64)),), {}), 256),  # token ids: batch x sequence
    (((), {"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": torch.ones(2, 8)}), 16),
    (((torch.randn(3, 10, 32),), {}), 30),  # a float sequence
    (((torch.randn(8, 32),), {}), 8),  # a batch of feature vectors
    (((torch.randn(2, 3, 16, 16),), {}), 2),  # images: the head sees the batch
    (((torch.tensor(1.0),), {}), None),
    (((), {}), None),
])
def test_rows_counts_what_the_linear_layers_see(sample, rows):
    assert inputs.rows(sample) == rows


def test_call_signatures_tell_call_forms_apart_and_the_one_tensor_path_agrees_with_the_walk():
    """The one-tensor shortcut must key the same call as the generic walk does (a shape seen as a keyword
    or positionally elsewhere is its own form), and tell shapes, dtypes and plain values apart."""
    sig = inputs.signature
    x = torch.randn(2, 3)
    assert sig((x,), {}) == ((tuple(x.shape), x.dtype),) and hash(sig((x,), {})) == hash((((2, 3), x.dtype),))
    assert sig((x,), {}) == sig((torch.zeros(2, 3),), {})  # values do not matter
    assert sig((x,), {}) == sig((nn.Parameter(x),), {})  # a subclass takes the walk, to the same key
    distinct = [sig((x,), {}), sig((x.double(),), {}), sig((x[:1],), {}), sig((), {"x": x}), sig((x, 1), {}),
                sig((x, 2), {}), sig((x,), {"flag": True}), sig((x,), {"flag": False}), sig((x, None), {})]
    assert len(set(distinct)) == len(distinct)


def test_detach_keeps_a_tensor_passed_twice_one_tensor():
    w = torch.ones(3, requires_grad=True)
    x = w * 2
    args, kwargs = inputs.detach(((x, x), {"labels": x, "other": w * 3}))
    assert args[0] is args[1] is kwargs["labels"] and not args[0].requires_grad
    assert kwargs["other"] is not args[0] and torch.equal(kwargs["other"], torch.full((3,), 3.0))


def test_describe_names_a_call_form_by_shapes_values_and_types():
    ids = torch.zeros(3, 43, dtype=torch.long)
    got = inputs.describe((ids,), {"attention_mask": ids, "return_dict": True, "cache": object()})
    assert got == "[3, 43], attention_mask [3, 43], return_dict=True, cache=<object>"
    assert inputs.describe((), {}) == "no arguments"
