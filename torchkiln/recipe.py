"""The Recipe: every decision optimize() makes, as frozen, printable data.

Plans are data so they can be tested, cached, tuned and explained: `print(recipe)`
reads as the plan, `recipe.to_json()` stores it, `Recipe.from_dict` restores it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

LEVELS = ("O0", "O1", "O2")
PASS_ORDER = (
    "replace_dropout",
    "fold_conv_bn",
    "fold_linear_bn",
    "concat_linear",
    "cast_dtype",
    "channels_last",
    "onednn_linear",
)


@dataclass(frozen=True)
class Recipe:
    device: str = "cpu"
    level: str = "O1"
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16
    dtype_mode: str = "none"  # none | cast (weights + activations) | autocast
    fp32_modules: tuple[str, ...] = ()  # module classes kept in fp32 under cast
    passes: tuple[str, ...] = ()  # in PASS_ORDER order
    memory_format: str = "contiguous"  # contiguous | channels_last
    gemm: str = "aten"  # aten | onednn (CPU linear path)
    attention: str = "sdpa"  # sdpa | auto (math form where measured faster, per shape)
    cudnn_benchmark: bool = False  # let cuDNN time its conv algorithms (during torchkiln's calls only)
    cuda_graphs: bool = False  # replay recorded CUDA graphs: no per-kernel launch cost
    compile: bool = True
    compile_options: tuple[tuple[str, object], ...] = ()  # inductor config overrides
    tolerance: float = 1e-4  # max relative error vs fp32 eager before falling back
    notes: tuple[str, ...] = field(default=(), compare=False)  # why each choice was made

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} is not one of {LEVELS}")
        unknown = set(self.passes) - set(PASS_ORDER)
        if unknown:
            raise ValueError(f"unknown passes {sorted(unknown)}; known: {PASS_ORDER}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compile_options"] = dict(self.compile_options)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, d: dict) -> Recipe:
        d = dict(d)
        d["compile_options"] = tuple(sorted(d.get("compile_options", {}).items()))
        for key in ("fp32_modules", "passes", "notes"):
            d[key] = tuple(d.get(key, ()))
        return cls(**d)

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        lines = [f"Recipe for {self.device} at {self.level}:"]
        lines.append(f"  dtype        {self.dtype} ({self.dtype_mode})")
        lines.append(f"  passes       {', '.join(self.passes) or '-'}")
        lines.append(f"  layout       {self.memory_format}")
        lines.append(f"  gemm         {self.gemm}")
        lines.append(f"  attention    {self.attention}")
        if self.cuda_graphs:
            lines.append("  cuda graphs  on (outputs cloned, calls serialised)")
        if self.compile:
            opts = ", ".join(f"{k}={v}" for k, v in self.compile_options)
            lines.append(f"  compile      inductor {opts or '(defaults)'}")
        else:
            lines.append("  compile      off")
        lines.append(f"  tolerance    rel err <= {self.tolerance:g}")
        lines += [f"  why: {n}" for n in self.notes]
        return "\n".join(lines)
