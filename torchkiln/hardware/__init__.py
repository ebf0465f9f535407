"""Detect the machine: CPU, accelerators (probed hang-safely), software."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import platform
import sys
from pathlib import Path

from . import probe as _probe
from .cpu import detect_cpu
from .model import AcceleratorInfo, CPUInfo, GPUPresence, Hardware, SoftwareInfo
from .topology import LogicalCPU, Topology, detect_topology

__all__ = [
    "AcceleratorInfo",
    "CPUInfo",
    "GPUPresence",
    "Hardware",
    "LogicalCPU",
    "SoftwareInfo",
    "Topology",
    "detect",
    "devices",
    "default_device",
    "resolve_device",
    "detect_topology",
]

log = logging.getLogger(__name__)

# Preference when several accelerator kinds exist: discrete compute first.
_PREFERENCE = ("cuda", "xpu", "mps")
_PCI_VENDORS = {"0x10de": "nvidia", "0x1002": "amd", "0x8086": "intel"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_software() -> SoftwareInfo:
    import torch

    backends = {
        "onednn": bool(torch.backends.mkldnn.is_available()),
        "mkl": bool(torch.backends.mkl.is_available()),
        "openmp": bool(torch.backends.openmp.is_available()),
        "cuda": torch.version.cuda is not None,
        "rocm": getattr(torch.version, "hip", None) is not None,
        "xpu": bool(getattr(torch.version, "xpu", None)) or hasattr(torch._C, "_xpu_getDeviceCount"),
        "mps": bool(torch.backends.mps.is_built()),
    }
    unknown = {}
    ao, tf = _version("torchao"), _version("transformers")
    if ao is None:
        unknown["torchao"] = "not installed"
    if tf is None:
        unknown["transformers"] = "not installed (pip install 'torchkiln[transformers]')"
    return SoftwareInfo(
        python=platform.python_version(),
        torch=torch.__version__,
        torchao=ao,
        transformers=tf,
        backends=backends,
        torch_cuda=torch.version.cuda,
        unknown=unknown,
    )


def detect_gpus_present(sysfs: str = "/sys/bus/pci/devices", proc: str = "/proc") -> tuple:
    """GPUs on the PCI bus, seen without torch: so we can say 'torch cannot see your GPU'."""
    found = []
    root = Path(sysfs)
    if not root.is_dir():
        return ()
    for dev in sorted(root.iterdir()):
        try:
            cls = (dev / "class").read_text().strip()
            vendor = (dev / "vendor").read_text().strip()
        except OSError:
            continue
        # 0x03xxxx display controllers, 0x1200xx processing accelerators.
        if not (cls.startswith("0x03") or cls.startswith("0x12")) or vendor not in _PCI_VENDORS:
            continue
        name = _PCI_VENDORS[vendor]
        loaded, version = _driver_state(name, proc)
        found.append(GPUPresence(vendor=name, pci_id=dev.name, driver_loaded=loaded, driver_version=version))
    return tuple(found)


def _driver_state(vendor: str, proc: str) -> tuple[bool | None, str | None]:
    if vendor == "nvidia":
        try:
            text = Path(proc, "driver/nvidia/version").read_text()
        except OSError:
            return False, None
        import re

        m = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", text)
        return True, m.group(1) if m else None
    module = {"amd": ("amdgpu",), "intel": ("i915", "xe")}[vendor]
    return any(Path("/sys/module", m).exists() for m in module), None


def _device_counts() -> dict[str, int]:
    """How many devices of each type torch can see, without initialising any of them."""
    import torch

    counts = {}
    if torch.cuda.is_available():  # NVML/driver query only; no context is created
        counts["cuda"] = torch.cuda.device_count()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        counts["xpu"] = xpu.device_count()
    if torch.backends.mps.is_available():
        counts["mps"] = 1
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        try:
            cur = acc.current_accelerator()
            if cur is not None and cur.type not in counts:
                counts[cur.type] = acc.device_count()
        except Exception as e:  # a broken out-of-tree backend must not break detection
            log.debug("torch.accelerator query failed: %s", e)
    return {k: v for k, v in counts.items() if v}


@functools.lru_cache(maxsize=8)
def detect(probe: bool = True, timeout: float | None = None) -> Hardware:
    """Describe this machine. Cached per process; ``detect.cache_clear()`` re-reads it.

    With ``probe=True`` each accelerator gets a hang-safe first touch in a child
    process (``timeout`` seconds, default 20) and is marked usable or not.
    """
    from .. import _log

    _log.configure()
    accs = []
    for dtype, count in _device_counts().items():
        results = _probe.probe(dtype, list(range(count)), timeout) if probe else {}
        for i in range(count):
            r = dict(results.get(f"{dtype}:{i}", {}))
            unknown = r.pop("unknown", {}) or {}
            if not probe:
                unknown["usable"] = "not probed (detect(probe=False))"
            elif not r.get("usable"):
                unknown["name"] = "device could not be probed"
            accs.append(
                AcceleratorInfo(
                    type=dtype,
                    index=i,
                    name=r.get("name"),
                    memory_bytes=r.get("memory_bytes"),
                    capability=r.get("capability"),
                    bf16=r.get("bf16"),
                    fp16=r.get("fp16"),
                    fp8=r.get("fp8"),
                    usable=r.get("usable") if probe else None,
                    problem=r.get("problem"),
                    probe_seconds=r.get("seconds"),
                    unknown=unknown,
                )
            )
    return Hardware(
        platform=f"{sys.platform}-{platform.machine()}",
        cpu=detect_cpu(),
        accelerators=tuple(accs),
        software=detect_software(),
        gpus_present=detect_gpus_present(),
    )


def devices(hw: Hardware | None = None) -> list[str]:
    """Usable devices, best first; "cpu" is always last and always present."""
    hw = hw or detect()
    usable = [a for a in hw.accelerators if a.usable]

    def rank(a: AcceleratorInfo):
        kind = _PREFERENCE.index(a.type) if a.type in _PREFERENCE else len(_PREFERENCE)
        return (kind, -(a.memory_bytes or 0), a.index)

    return [a.device for a in sorted(usable, key=rank)] + ["cpu"]


def default_device(hw: Hardware | None = None) -> str:
    return devices(hw)[0]


def resolve_device(device, hw: Hardware | None = None, arg: str = "device={!r}"):
    """``device`` as a torch.device (an accelerator with its index), checked usable here; else a
    ValueError naming the argument (``arg``, formatted with the value) and the usable devices."""
    import torch

    from ..modelutil import first_line

    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{arg.format(device)} is not a device torch knows ({first_line(e)}); usable devices: "
                         f"{devices(hw)}") from None
    if target.type == "cpu":
        return torch.device("cpu")
    if target.index is None:
        target = torch.device(target.type, 0)
    hw = hw or detect()
    acc = hw.accelerator(str(target))
    if acc is None or not acc.usable:
        why = acc.problem if acc is not None else "not present"
        raise ValueError(f"{arg.format(str(target))} is not usable ({why}); usable devices: {devices(hw)}. "
                         "Run `torchkiln doctor` for the cause and fix.")
    return target
