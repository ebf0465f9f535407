"""The numeric guard's rules for integer and boolean outputs (torchkiln/guard.py): the share of
elements that differ, held to the tolerances float outputs get; references are counted by hand."""

import copy

import torch

import torchkiln as tk
from torchkiln.guard import FLOOR, compare_each, tolerances, verdict


def test_discrete_outputs_count_the_share_of_elements_that_differ():
    ref = torch.zeros(1000, dtype=torch.bool)
    out = ref.clone()
    out[:3] = True
    e = compare_each(out, ref)[0]
    assert e.discrete and e.rel == 3 / 1000 and e.max_abs == 1.0
    idx = torch.arange(10)
    moved = idx.clone()
    moved[4] = 9
    e = compare_each(moved, idx)[0]
    assert e.rel == 0.1 and e.max_abs == 5.0
    assert compare_each(idx.int(), idx)[0].rel == float("inf")  # another dtype is another answer
    assert "0.300% of elements differ" in str(compare_each(out, ref)[0])


def test_a_few_flips_pass_at_low_precision_but_a_small_output_must_match():
    ref = torch.zeros(10_000, dtype=torch.bool)
    few = ref.clone()
    few[:5] = True  # 0.05%: below bf16's floor with a plain cast that flipped none
    many = ref.clone()
    many[:50] = True  # 0.5%
    base = compare_each(ref, ref)  # the plain cast agreed exactly
    tol = tolerances(torch.bfloat16, base, 1)
    assert tol == [FLOOR[torch.bfloat16]]
    assert verdict(few, ref, tol).ok and not verdict(many, ref, tol).ok
    assert not verdict(torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]), tol).ok  # 3 elements: one flip fails
    assert not verdict(few, ref, tolerances(torch.float32, None, 1)).ok  # float32: 1e-4 of 10k elements


def test_a_bf16_classifier_returning_a_threshold_mask_keeps_its_compiled_candidates():
    """Exact equality failed every compiled candidate on a `softmax > t` output (found by probe, twenty-ninth
    session). The served answer is checked against float32 by hand here."""
    torch.manual_seed(0)

    class Cls(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 500))

        def forward(self, x):
            logits = self.net(x)
            return logits, logits.softmax(-1) > 0.002

    m, x = Cls().eval(), torch.randn(64, 64)
    fast = tk.optimize(m, dtype=torch.bfloat16, sample_input=x, candidates="torchkiln", time_budget=0.2)
    with torch.no_grad():
        logits, mask = fast(x)
        ref_logits, ref_mask = m(x)
        cast_mask = copy.deepcopy(m).bfloat16()(x.bfloat16())[1]  # the plain cast, by hand
    baseline = float((cast_mask != ref_mask).double().mean())
    assert float((mask != ref_mask).double().mean()) <= 2 * baseline + FLOOR[torch.bfloat16]
    assert not [c for c in fast.kiln_report.candidates if "differ" in (c.reason or "")]


def test_a_dataclass_output_is_compared_field_by_field():
    """A model's own output dataclass (no pytree node) was one opaque leaf: no tensor compared, every
    candidate passed unverified. Its tensors now count, nested ones too; CUDA-graph copies clone them."""
    import dataclasses

    from torchkiln import inputs

    @dataclasses.dataclass(frozen=True)
    class Out:
        logits: torch.Tensor
        extra: tuple
        name: str = "x"

    a, b = torch.randn(4, 10), torch.randn(3)
    ref = Out(a, (b, 7))
    assert [t.data_ptr() for t in inputs.flatten(ref)] == [a.data_ptr(), b.data_ptr()]
    tols = tolerances(torch.float32, None, 2)
    assert verdict(Out(a.clone(), (b.clone(), 7)), ref, tols).ok
    assert not verdict(Out(a, (b * 1.01, 7)), ref, tols).ok
    assert compare_each(ref, ref)[0].argmax_agree == 1.0  # (N, C): read as logits
    copied = inputs.clone((ref,))[0]
    assert type(copied) is Out and copied.name == "x" and copied.extra[1] == 7
    assert copied.logits.data_ptr() != a.data_ptr() and torch.equal(copied.extra[0], b)
