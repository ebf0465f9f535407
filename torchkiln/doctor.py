"""`torchkiln doctor`: the hardware model, usable devices, and for each
accelerator that is present but unusable, the likely cause and the fix."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .hardware import Hardware, default_device, detect, devices

# Oldest NVIDIA driver each CUDA major runs on (NVIDIA's compatibility table,
# minor-version compatibility): a driver older than this explains
# "cuda present, torch.cuda.is_available() is False".
_MIN_DRIVER = {11: 450, 12: 525, 13: 580}
_TORCH_INDEX = "https://download.pytorch.org/whl"


@dataclass(frozen=True)
class Problem:
    device: str
    cause: str  # short machine-readable tag
    detail: str
    fix: str


def _cuda_wheel_tag(driver: str | None) -> str:
    major = int(driver.split(".")[0]) if driver else None
    if major is None or major >= 580:
        return "cu130"
    if major >= 525:
        return "cu126"
    return "cu118"


def diagnose(hw: Hardware, env: dict | None = None) -> list[Problem]:
    env = os.environ if env is None else env
    problems = []
    sw = hw.software
    for acc in hw.accelerators:
        if acc.usable is False:
            timed_out = "timed out" in (acc.problem or "")
            problems.append(
                Problem(
                    device=acc.device,
                    cause="probe_timeout" if timed_out else "probe_failed",
                    detail=acc.problem or "",
                    fix=(
                        "The device never finished its first kernel: update the GPU driver and "
                        "runtime, use a torch build with ahead-of-time kernels for this device, "
                        "or raise the timeout (TORCHKILN_PROBE_TIMEOUT / --probe-timeout). "
                        "torchkiln uses the next device meanwhile."
                        if timed_out
                        else "Run `python -c \"import torch; torch.ones(1, device='"
                        f"{acc.device}')\"` to see the full error; usually a driver/runtime "
                        "mismatch or a device the torch build has no kernels for."
                    ),
                )
            )
    seen_cuda = any(a.type == "cuda" for a in hw.accelerators)
    for gpu in hw.gpus_present:
        if gpu.vendor == "nvidia" and not seen_cuda:
            problems.append(_nvidia_unseen(gpu, sw, env))
        elif gpu.vendor == "amd" and not seen_cuda and not sw.backends.get("rocm"):
            problems.append(
                Problem(
                    device="rocm",
                    cause="torch_without_backend",
                    detail="an AMD GPU is present but this torch build has no ROCm support",
                    fix=f"pip install torch --index-url {_TORCH_INDEX}/rocm6.4",
                )
            )
        elif gpu.vendor == "intel" and not any(a.type == "xpu" for a in hw.accelerators):
            if not sw.backends.get("xpu"):
                problems.append(
                    Problem(
                        device="xpu",
                        cause="torch_without_backend",
                        detail="an Intel GPU is present but this torch build has no XPU support "
                        "(integrated GPUs without compute drivers also land here)",
                        fix=f"pip install torch --index-url {_TORCH_INDEX}/xpu  "
                        "(and install Intel's GPU compute runtime / Level Zero driver)",
                    )
                )
    # Deduplicate: several GPUs of one vendor share one cause.
    unique = {(p.device, p.cause): p for p in problems}
    return list(unique.values())


def _nvidia_unseen(gpu, sw, env) -> Problem:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return Problem(
            "cuda",
            "hidden_by_env",
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU",
            "unset CUDA_VISIBLE_DEVICES or list the GPUs to use (e.g. CUDA_VISIBLE_DEVICES=0)",
        )
    if not gpu.driver_loaded:
        return Problem(
            "cuda",
            "no_driver",
            f"an NVIDIA GPU is on the PCI bus ({gpu.pci_id}) but no NVIDIA kernel driver is loaded",
            "install the NVIDIA driver (e.g. `sudo ubuntu-drivers install` or your distro's "
            "nvidia-driver package) and reboot; check with `nvidia-smi`",
        )
    if not sw.backends.get("cuda"):
        tag = _cuda_wheel_tag(gpu.driver_version)
        return Problem(
            "cuda",
            "torch_without_backend",
            f"an NVIDIA GPU with driver {gpu.driver_version or '?'} is present, but torch "
            f"{sw.torch} is a CPU-only build",
            f"pip install --force-reinstall torch --index-url {_TORCH_INDEX}/{tag}",
        )
    need = _MIN_DRIVER.get(int((sw.torch_cuda or "0").split(".")[0]))
    have = int(gpu.driver_version.split(".")[0]) if gpu.driver_version else None
    if need and have and have < need:
        tag = _cuda_wheel_tag(gpu.driver_version)
        return Problem(
            "cuda",
            "version_mismatch",
            f"torch is built for CUDA {sw.torch_cuda}, which needs driver >= {need}; "
            f"this machine has {gpu.driver_version}",
            f"upgrade the NVIDIA driver, or install a torch built for an older CUDA: "
            f"pip install --force-reinstall torch --index-url {_TORCH_INDEX}/{tag}",
        )
    return Problem(
        "cuda",
        "not_visible",
        "an NVIDIA GPU and driver are present but torch.cuda.is_available() is False",
        "run `nvidia-smi`; check /dev/nvidia* permissions and that the container was started "
        "with GPU access (e.g. docker --gpus all)",
    )


def probe_timeout_from_env(env: dict | None = None) -> float | None:
    env = os.environ if env is None else env
    raw = env.get("TORCHKILN_PROBE_TIMEOUT")
    if not raw:
        return None
    if not re.fullmatch(r"\d+(\.\d+)?", raw.strip()):
        raise ValueError(f"TORCHKILN_PROBE_TIMEOUT={raw!r} is not a number of seconds (e.g. 20)")
    return float(raw)


def run(timeout: float | None = None) -> dict:
    """Everything `doctor` reports, as a JSON-ready dict."""
    hw = detect(probe=True, timeout=timeout if timeout is not None else probe_timeout_from_env())
    probs = diagnose(hw)
    return {
        "hardware": hw.to_dict(),
        "devices": devices(hw),
        "default_device": default_device(hw),
        "problems": [p.__dict__ for p in probs],
        "quantization": quant_schemes(hw),
        "onednn_net": onednn_net(),
    }


def onednn_net() -> dict:
    """Whether the CNN runner (kernels/onednn_net.cpp: int8, float32 and bf16 conv nets) can be built
    here: its oneDNN found (library and headers), or why not. Looks only; the first optimize of a CPU
    conv net compiles it."""
    from .kernels import onednn_net as kernel

    found = kernel.find()
    if isinstance(found, str):
        return {"available": False, "detail": found}
    return {"available": True, "detail": f"oneDNN at {found[0]}"}


def quant_schemes(hw: Hardware) -> dict[str, dict[str, list]]:
    """Per usable device: scheme -> [fast here, why] (tk.quantize warns on the slow ones)."""
    import torch

    from .quantization.schemes import fast_schemes

    return {d: {s: list(v) for s, v in fast_schemes(torch.device(d), hw).items()} for d in devices(hw)}


def quant_line(device: str, schemes: dict[str, list]) -> str:
    fast = [s for s, (ok, _) in schemes.items() if ok]
    slow = [s for s, (ok, _) in schemes.items() if not ok]
    return f"{device}: fast {', '.join(fast) or '-'}; not fast here: {', '.join(slow) or '-'}"


def allocators() -> dict[str, str | None]:
    """The allocators `torchkiln run` can preload: name -> path, or None when not found."""
    from .runtime.preload import ALLOCATORS, find_library

    return {name: find_library(name) for name in ALLOCATORS}


def allocator_line(found: dict[str, str | None]) -> str:
    from .runtime.preload import PACKAGES

    parts = [f"{name}: {path}" if path else f"{name}: not found ({PACKAGES[name]})"
             for name, path in found.items()]
    return "; ".join(parts) + "  (`torchkiln run` preloads the first found)"
