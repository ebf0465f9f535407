"""training/recipe.py: the training plan as data, on fake machines."""

import json

import pytest
import torch
from plan.fakes import H100, X86_BF16, XPU

from torchkiln.passes import registry
from torchkiln.training.recipe import TrainRecipe, plan_training

NOTE = ("fused", "AdamW switched to torch's fused step")


@pytest.mark.parametrize("hw, device, passes", [
    (X86_BF16, "cpu", ("full_mask", "hash_dropout")),  # inductor's per-element Philox is the CPU's cost
    (H100, "cuda:0", ("full_mask",)),  # Triton's RNG is not: nothing measured to replace there
    (XPU, "xpu:0", ("full_mask",)),
])
def test_compiled_steps_on_a_cpu_get_hash_dropout(hw, device, passes):
    rec = plan_training(hw, device, torch.bfloat16, "O1", {}, NOTE)
    assert tuple(p.name for p in rec.passes) == passes
    hashed = "hash_dropout" in passes
    assert ("dropout in the compiled step" in " ".join(rec.notes)) == hashed
    assert ("hash_dropout" in str(rec)) == hashed


@pytest.mark.parametrize("level, knobs", [("O0", {}), ("O1", {"graph_mode": False})])
def test_no_compiled_step_no_graph_pass(level, knobs):
    assert plan_training(X86_BF16, "cpu", torch.bfloat16, level, knobs, NOTE).passes == ()


def test_recipe_serialises_its_passes_by_name():
    rec = plan_training(X86_BF16, "cpu", torch.bfloat16, "O1", {}, NOTE)
    d = json.loads(rec.to_json())
    assert d["passes"] == [{"pass": "full_mask"}, {"pass": "hash_dropout"}]
    again = TrainRecipe(**{**d, "passes": tuple(registry.from_dict(p) for p in d["passes"]),
                           "notes": tuple(d["notes"])})
    assert again == rec


def test_unknown_passes_fail_loudly():
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True)
    class Nope:
        name: ClassVar[str] = "no_such_pass"

    with pytest.raises(ValueError, match="no_such_pass"):
        TrainRecipe(passes=(Nope(),))


@pytest.mark.parametrize("hw, device, level, knobs, want", [
    (X86_BF16, "cpu", "O1", {}, "keep"),  # CPU training: glibc keeps the step's large blocks
    (X86_BF16, "cpu", "O1", {"graph_mode": False}, "keep"),  # eager steps allocate the same tensors
    (X86_BF16, "cpu", "O0", {}, "default"),  # O0 changes nothing
    (X86_BF16, "cpu", "O1", {"cpu_allocator": "default"}, "default"),
    (H100, "cuda:0", "O1", {}, "default"),  # CUDA has its own caching allocator
    (H100, "cuda:0", "O1", {"cpu_allocator": "keep"}, "default"),
])
def test_the_allocator_choice(hw, device, level, knobs, want):
    rec = plan_training(hw, device, torch.bfloat16, level, knobs, NOTE)
    assert rec.allocator == want
    assert ("keeps freed memory" in str(rec)) == (want == "keep")
    if knobs.get("cpu_allocator") == "keep" and want == "default":
        assert any("cpu_allocator='keep': not used" in n for n in rec.notes)


def test_a_bad_allocator_value_names_the_knob_and_the_choices():
    with pytest.raises(ValueError, match=r"cpu_allocator='jemalloc' must be 'keep'.*'default'"):
        plan_training(X86_BF16, "cpu", torch.bfloat16, "O1", {"cpu_allocator": "jemalloc"}, NOTE)


@pytest.mark.parametrize("hw, device, level, knobs, distributed, want", [
    (H100, "cuda:0", "O2", {}, False, True),  # a timed candidate beside the plain compiled step
    (H100, "cuda:0", "O1", {}, False, False),  # not faster in its own timing, two more compiles
    (H100, "cuda:0", "O0", {}, False, False),  # nothing compiled
    (H100, "cuda:0", "O2", {"graph_mode": False}, False, False),
    (H100, "cuda:0", "O2", {}, True, False),  # collectives would be captured
    (H100, "cuda:0", "O2", {"split_master_weight_for_bf16": True}, False, False),  # rebuilds move the weights
    (X86_BF16, "cpu", "O2", {}, False, False),  # no CUDA graphs on a CPU
])
def test_the_cuda_graphs_candidate_is_planned_only_where_it_can_serve(hw, device, level, knobs, distributed, want):
    rec = plan_training(hw, device, torch.bfloat16, level, knobs, NOTE, distributed=distributed)
    assert rec.graphs is want
    assert ("under CUDA graphs" in str(rec)) is want
    assert json.loads(rec.to_json())["graphs"] is want
