"""The training plan: every decision tk.optimize(model, optimizer=...) makes, as
frozen, printable, JSON-serialisable data (the inference Recipe's sibling).

Precision rule (documented in docs/training.md):
- bf16 where the device runs it natively: autocast, parameters and optimizer
  state stay fp32. Split master weights (bf16 weights plus 16-bit trails that
  rebuild the exact fp32 masters, training/split.py) on request:
  ``split_master_weight_for_bf16=True``. They cut GPT-2-medium's training peak
  by 9% on the H200 but add a rebuild and a split to every step (0.96x), so they
  are not the default (benchmarks/RESULTS.md, "Split master weights").
  Not under a process group: DDP/FSDP build their buckets and shards from the
  parameters' dtype before or after the call.
- bf16 requested on a CPU without native bf16: trained in fp32 with a warning
  (emulated bf16 is slower than fp32 there), as inference does.
- fp16: autocast; gradients need loss scaling: ``tk.amp.GradScaler`` in the loop.
  fp16 on a CPU without native fp16 is an error that names the alternatives.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from ..hardware import Hardware
from ..modelutil import dtype_name
from ..passes import registry
from ..plan import family


@dataclass(frozen=True)
class TrainRecipe:
    device: str = "cpu"
    level: str = "O1"
    dtype: str = "float32"  # compute dtype under autocast (float32: no autocast); with precision "params", the model's
    precision: str = "fp32"  # fp32 | autocast | params (the model's own bf16/fp16 parameters, no autocast)
    loss_scaling: bool = False  # fp16: gradients need a GradScaler
    compile: bool = True  # a compiled forward+backward is a candidate (timed against eager)
    graphs: bool = False  # the compiled step under CUDA graphs is a candidate too (training/graphs.py)
    optimizer: str = "unchanged"  # fused (torch's fused=True) | torchkiln | own step | unchanged
    master_weights: str = "fp32"  # fp32 (the parameters themselves) | split (bf16 + 16-bit trail)
    passes: tuple = ()  # graph pass configs (the registry) for the compiled step
    allocator: str = "default"  # keep (glibc keeps freed memory: runtime/allocator.py) | default
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self):
        object.__setattr__(self, "passes", registry.ordered(self.passes))  # unknown passes fail loudly

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passes"] = [registry.to_dict(p) for p in self.passes]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"TrainRecipe for {self.device} at {self.level}:",
                 f"  precision    {self.dtype} ({self.precision})" + (", loss scaling" if self.loss_scaling else ""),
                 f"  compile      {'forward+backward, timed against eager' if self.compile else 'off'}"
                 + (", and under CUDA graphs" if self.graphs else ""),
                 f"  optimizer    {self.optimizer}",
                 f"  masters      {'split: bf16 weights + 16-bit trails' if self.master_weights == 'split' else 'fp32 parameters'}",
                 f"  graph passes {', '.join(p.name for p in self.passes) or '-'}",
                 f"  allocator    {'keeps freed memory (glibc, process-wide)' if self.allocator == 'keep' else 'as it is'}"]
        return "\n".join(lines + [f"  why: {n}" for n in self.notes])


def plan_training(hw: Hardware, device: str, dtype: torch.dtype, level: str, knobs: dict,
                  optimizer_note: tuple[str, str], distributed: bool = False,
                  own: torch.dtype = torch.float32) -> TrainRecipe:
    """``own``: the model's parameters' dtype (a model cast to bf16 trains in it, whatever autocast says)."""
    notes: list[str] = []
    if dtype == torch.float16 and torch.device(device).type == "cpu" and not hw.cpu.fp16_native:
        alt = "dtype=torch.bfloat16" if hw.cpu.bf16_native else "dtype=None (float32)"
        raise ValueError(f"dtype=torch.float16 cannot train fast on this CPU (no AVX512_FP16/AMX-FP16: fp16 "
                         f"would be emulated); use {alt}")
    chosen, why = family(device).choose_dtype(hw, device, dtype)
    if why:
        notes.append(why)
    low = chosen != torch.float32
    split = _split_choice(knobs.get("split_master_weight_for_bf16"), chosen, distributed, notes)
    if own != torch.float32:
        notes.append(f"the model's parameters are {dtype_name(own)}: they, their gradients and the optimizer "
                     f"state stay {dtype_name(own)}, as given")
    elif low and not split:
        notes.append(f"{dtype_name(chosen)} autocast: parameters, gradients and optimizer state stay float32")
    if chosen == torch.float16:
        notes.append("float16: use tk.amp.GradScaler in the loop (loss scaling), or gradients underflow")
    compile_ = level != "O0" and knobs.get("graph_mode") is not False
    if level == "O0":
        notes.append("O0: no compilation, no optimizer change")
    elif knobs.get("graph_mode") is False:
        notes.append("graph_mode=False: eager forward and backward")
    kind, why = optimizer_note
    notes.append(f"optimizer: {why}")
    passes = (registry.make("full_mask"),) if compile_ else ()  # passes/full_mask.py: bert-large on the H200
    if compile_ and torch.device(device).type == "cpu":
        passes += (registry.make("hash_dropout"),)
        notes.append("dropout in the compiled step: masks from a counter hash, not inductor's per-element Philox "
                     "(bert-base bs8: 0.65 s of a 3.4 s step on 2 cores; passes/hash_dropout.py)")
    # O2 only: on the H200, GPT-2-medium bs16 seq512's step under CUDA graphs timed 51.95 ms against the plain
    # compiled step's 51.73 in tk.optimize's own timing (stock reduce-overhead ran 1.02-1.06x stock compile in a
    # loop), and building it took two more compiles (optimize 223-263 s; benchmarks/RESULTS.md, forty-fourth session).
    graphs = compile_ and level == "O2" and torch.device(device).type == "cuda" and not distributed and not split
    if graphs:
        notes.append("O2: the compiled step is also timed replayed as CUDA graphs (training/graphs.py)")
    allocator = _allocator_choice(knobs.get("cpu_allocator"), device, level, notes)
    # a model cast to bf16/fp16 trains in its own dtype (no autocast): the recipe says that dtype, not float32
    precision, served = ("autocast", chosen) if low else ("params", own) if own != torch.float32 else ("fp32", chosen)
    return TrainRecipe(device=device, level=level, dtype=dtype_name(served), precision=precision,
                       loss_scaling=chosen == torch.float16, compile=compile_, graphs=graphs, optimizer=kind,
                       master_weights="split" if split else "fp32", passes=passes, allocator=allocator,
                       notes=tuple(notes))


def _allocator_choice(asked, device: str, level: str, notes: list[str]) -> str:
    if asked not in (None, "keep", "default"):
        raise ValueError(f"cpu_allocator={asked!r} must be 'keep' (glibc keeps freed memory for reuse), 'default' "
                         "(leave malloc as it is) or None (torchkiln decides: 'keep' for CPU training)")
    if torch.device(device).type != "cpu":
        if asked == "keep":
            notes.append(f"cpu_allocator='keep': not used, training runs on {device}")
        return "default"
    if asked == "default" or (asked is None and level == "O0"):
        return "default"
    notes.append("allocator: glibc keeps freed memory, so the step's large tensors are not faulted in again each "
                 "step (bert-base bs8: 150,000 page faults a step, 1.17x with them gone; runtime/allocator.py)")
    return "keep"


def _split_choice(asked, chosen: torch.dtype, distributed: bool, notes: list[str]) -> bool:
    if asked not in (None, True, False):
        raise ValueError(f"split_master_weight_for_bf16={asked!r} must be True, False or None (torchkiln decides)")
    if not asked:
        return False
    if chosen != torch.bfloat16:
        notes.append(f"split_master_weight_for_bf16: not used, training runs in {dtype_name(chosen)}, not bfloat16")
        return False
    if distributed:
        notes.append("split_master_weight_for_bf16: not used under a process group (DDP/FSDP bucket and shard "
                     "the parameters by dtype); autocast with float32 parameters instead")
        return False
    notes.append("bfloat16 weights with 16-bit trails (split master weights, asked for): the optimizer steps "
                 "the exact float32 masters; other parameters and optimizer state stay float32")
    return True
