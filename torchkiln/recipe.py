"""The Recipe: every decision optimize() makes, as frozen, printable data.

Plans are data so they can be tested, cached, tuned and explained: `print(recipe)`
reads as the plan, `recipe.to_json()` stores it, `Recipe.from_dict` restores it.
Passes are held as their registered config dataclasses (passes/registry.py), in
run order.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from .passes import registry

LEVELS = ("O0", "O1", "O2")
ATTENTION = ("sdpa", "auto", "auto-bf16", "opaque")


@dataclass(frozen=True)
class Recipe:
    device: str = "cpu"
    level: str = "O1"
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16
    dtype_mode: str = "none"  # none | cast (weights + activations) | autocast
    passes: tuple = ()  # pass configs (registry), in run order
    memory_format: str = "contiguous"  # contiguous | channels_last
    # sdpa: untouched | auto: math or SDPA per shape, measured (CPU) | auto-bf16: as auto, the
    # math form for float32 inputs run in bf16 (int8 models on native-bf16 CPUs) | opaque: SDPA
    # as an opaque op, so compiled graphs keep the kernel eager would pick (CUDA, accelerators)
    attention: str = "sdpa"
    drop_all_ones_mask: bool = False  # HF models: an all-ones attention_mask is passed as None
    cudnn_benchmark: bool = False  # let cuDNN time its conv algorithms (during torchkiln's calls only)
    cuda_graphs: bool = False  # replay recorded CUDA graphs: no per-kernel launch cost
    compile: bool = True
    compile_options: tuple[tuple[str, object], ...] = ()  # inductor config overrides
    static_shapes: bool = False  # one compiled graph per input shape (torch.compile dynamic=False)
    # CPU: also time a TorchScript trace served by oneDNN: through oneDNN Graph's fuser
    # (passes/onednn_graph.py); for a pt2e int8 conv graph, through torch's oneDNN quantized
    # modules (quantization/onednn_int8.py)
    onednn_graph: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)  # why each choice was made

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} is not one of {LEVELS}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not one of {ATTENTION}")
        for p in self.passes:
            if not dataclasses.is_dataclass(p) or not hasattr(p, "name"):
                raise ValueError(f"passes must hold pass configs (registry.make(name, ...)), got {p!r}")
            registry.lookup(p.name)  # unknown passes fail loudly
        object.__setattr__(self, "passes", registry.ordered(self.passes))

    @property
    def pass_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def pass_config(self, name: str):
        return next((p for p in self.passes if p.name == name), None)

    @property
    def gemm(self) -> str:
        return "onednn" if "onednn_linear" in self.pass_names else "aten"

    @property
    def fp32_modules(self) -> tuple[str, ...]:
        cast = self.pass_config("cast_dtype")
        return cast.fp32_modules if cast is not None else ()

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["passes"] = [registry.to_dict(p) for p in self.passes]
        d["compile_options"] = dict(self.compile_options)
        d["notes"] = list(self.notes)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, d: dict) -> Recipe:
        d = dict(d)
        d["compile_options"] = tuple(sorted(d.get("compile_options", {}).items()))
        d["passes"] = tuple(registry.from_dict(p) for p in d.get("passes", ()))
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)

    def without(self, *names: str) -> Recipe:
        return self.replace(passes=tuple(p for p in self.passes if p.name not in names))

    def __str__(self) -> str:
        lines = [f"Recipe for {self.device} at {self.level}:"]
        lines.append(f"  dtype        {self.dtype} ({self.dtype_mode})")
        for i, p in enumerate(self.passes):
            opts = ", ".join(f"{k}={v}" for k, v in registry.to_dict(p).items() if k not in ("pass", "fp32_modules"))
            lines.append(f"  {'passes' if i == 0 else '':<12} {p.name}" + (f" ({opts})" if opts else ""))
        if not self.passes:
            lines.append("  passes       -")
        lines.append(f"  layout       {self.memory_format}")
        lines.append(f"  gemm         {self.gemm}")
        lines.append(f"  attention    {self.attention}" + (" (all-ones masks dropped)" if self.drop_all_ones_mask else ""))
        if self.cuda_graphs:
            lines.append("  cuda graphs  on (outputs cloned, calls serialised)")
        if self.compile:
            opts = ", ".join(f"{k}={v}" for k, v in self.compile_options)
            lines.append(f"  compile      inductor {opts or '(defaults)'}" + (", static shapes" if self.static_shapes else ""))
        else:
            lines.append("  compile      off")
        if self.onednn_graph:
            how = "oneDNN quantized modules" if self.pass_config("quantize") else "oneDNN Graph's fuser"
            lines.append(f"  torchscript  timed as a candidate, through {how} (a trace per input shape)")
        lines += [f"  why: {n}" for n in self.notes]
        return "\n".join(lines)
