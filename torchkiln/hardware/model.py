"""The hardware model: frozen, JSON-serialisable facts about this machine.

A fact that could not be read is ``None`` and its field name maps to the reason
in ``unknown``; detection never raises for a missing fact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _unknown_field():
    return field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class CPUInfo:
    arch: str | None
    vendor: str | None
    model: str | None
    physical_cores: int | None
    logical_cores: int | None
    sockets: int | None
    numa_nodes: int | None
    memory_bytes: int | None
    features: tuple[str, ...] = ()
    unknown: dict = _unknown_field()

    def has(self, *features: str) -> bool:
        return all(f in self.features for f in features)

    @property
    def is_intel(self) -> bool:
        return (self.vendor or "").lower() in ("genuineintel", "intel")

    @property
    def is_amd(self) -> bool:
        return (self.vendor or "").lower() in ("authenticamd", "amd")

    @property
    def bf16_native(self) -> bool:
        """bf16 matmul runs in hardware (not emulated through fp32)."""
        return self.has("avx512_bf16") or self.has("amx_bf16") or self.has("bf16")

    @property
    def fp16_native(self) -> bool:
        return self.has("avx512_fp16") or self.has("amx_fp16") or self.has("neon_fp16")

    @property
    def int8_dot(self) -> bool:
        return any(self.has(f) for f in ("avx512_vnni", "avx_vnni", "amx_int8", "i8mm", "dotprod"))


@dataclass(frozen=True)
class AcceleratorInfo:
    type: str  # "cuda", "xpu", "mps", or any torch.accelerator device type
    index: int
    name: str | None = None
    memory_bytes: int | None = None
    capability: str | None = None  # "9.0" on CUDA, gfx arch on ROCm, None where the API has none
    bf16: bool | None = None
    fp16: bool | None = None
    fp8: bool | None = None
    usable: bool | None = None  # None: not probed
    problem: str | None = None  # why it is not usable
    probe_seconds: float | None = None
    unknown: dict = _unknown_field()

    @property
    def device(self) -> str:
        return f"{self.type}:{self.index}"


@dataclass(frozen=True)
class SoftwareInfo:
    python: str
    torch: str
    torchao: str | None
    transformers: str | None
    backends: dict = field(default_factory=dict, compare=False, hash=False)  # name -> bool
    torch_cuda: str | None = None  # CUDA version torch was built with
    unknown: dict = _unknown_field()


@dataclass(frozen=True)
class GPUPresence:
    """A GPU seen on the PCI bus or through a driver, whether or not torch can use it."""

    vendor: str  # "nvidia", "amd", "intel"
    pci_id: str | None = None
    driver_loaded: bool | None = None
    driver_version: str | None = None


@dataclass(frozen=True)
class Hardware:
    platform: str
    cpu: CPUInfo
    accelerators: tuple[AcceleratorInfo, ...]
    software: SoftwareInfo
    gpus_present: tuple[GPUPresence, ...] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def accelerator(self, device: str) -> AcceleratorInfo | None:
        for acc in self.accelerators:
            if acc.device == device or (acc.type == device and acc.index == 0):
                return acc
        return None
