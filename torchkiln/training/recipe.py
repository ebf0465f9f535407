"""The training plan: every decision tk.optimize(model, optimizer=...) makes, as
frozen, printable, JSON-serialisable data (the inference Recipe's sibling).

Precision rule (documented in docs/training.md):
- bf16 where the device runs it natively: autocast, parameters and optimizer
  state stay fp32. (Split bf16 weights with fp32 masters halve parameter memory;
  not built yet: autocast is what stock PyTorch recommends and keeps
  ``state_dict`` fp32 for free.)
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
from ..plan import family


@dataclass(frozen=True)
class TrainRecipe:
    device: str = "cpu"
    level: str = "O1"
    dtype: str = "float32"  # compute dtype under autocast (float32: no autocast)
    precision: str = "fp32"  # fp32 | autocast
    loss_scaling: bool = False  # fp16: gradients need a GradScaler
    compile: bool = True  # a compiled forward+backward is a candidate (timed against eager)
    optimizer: str = "unchanged"  # fused (torch's fused=True) | torchkiln | own step | unchanged
    notes: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"TrainRecipe for {self.device} at {self.level}:",
                 f"  precision    {self.dtype} ({self.precision})" + (", loss scaling" if self.loss_scaling else ""),
                 f"  compile      {'forward+backward, timed against eager' if self.compile else 'off'}",
                 f"  optimizer    {self.optimizer}"]
        return "\n".join(lines + [f"  why: {n}" for n in self.notes])


def plan_training(hw: Hardware, device: str, dtype: torch.dtype, level: str, knobs: dict,
                  optimizer_note: tuple[str, str]) -> TrainRecipe:
    notes: list[str] = []
    if dtype == torch.float16 and torch.device(device).type == "cpu" and not hw.cpu.fp16_native:
        alt = "dtype=torch.bfloat16" if hw.cpu.bf16_native else "dtype=None (float32)"
        raise ValueError(f"dtype=torch.float16 cannot train fast on this CPU (no AVX512_FP16/AMX-FP16: fp16 "
                         f"would be emulated); use {alt}")
    chosen, why = family(device).choose_dtype(hw, device, dtype)
    if why:
        notes.append(why)
    low = chosen != torch.float32
    if low:
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
    return TrainRecipe(device=device, level=level, dtype=dtype_name(chosen), precision="autocast" if low else "fp32",
                       loss_scaling=chosen == torch.float16, compile=compile_, optimizer=kind, notes=tuple(notes))
