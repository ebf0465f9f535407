"""Hang-safe first touch of each accelerator.

Some devices never return from their first allocation or kernel (an Intel
iGPU whose kernels are JIT-compiled at first touch hangs in ``model.to("xpu")``).
So the first touch runs in a child process with a timeout: a device that hangs
or crashes there is reported and skipped, and the caller never hangs.

Results are cached for the life of the process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 20.0
# Tests (and users reproducing a report) make a device misbehave inside the
# child, at the exact point a real device would: "cuda:0=hang,xpu:0=fail".
FAULT_ENV = "TORCHKILN_PROBE_FAULT"

_cache: dict[str, dict] = {}


def _child_main(device_type: str, index: int) -> None:
    """Runs in the child: touch the device, print one JSON line with its properties."""
    fault = dict(
        item.split("=", 1) for item in os.environ.get(FAULT_ENV, "").split(",") if "=" in item
    ).get(f"{device_type}:{index}")
    if fault == "hang":
        time.sleep(3600)
    if fault == "fail":
        raise RuntimeError(f"simulated failure at first touch of {device_type}:{index}")
    if fault == "crash":
        os.abort()
    import torch

    dev = torch.device(device_type, index)
    x = torch.arange(1024, dtype=torch.float32, device=dev)
    got = float((x * 2).sum().item())
    if got != 1047552.0:  # 2 * sum(range(1024))
        raise RuntimeError(f"tiny kernel on {dev} returned {got}, expected 1047552.0")
    print(json.dumps(_properties(torch, device_type, index)))


def _properties(torch, device_type: str, index: int) -> dict:
    props: dict = {"unknown": {}}
    if device_type == "cuda":
        p = torch.cuda.get_device_properties(index)
        props.update(name=p.name, memory_bytes=int(p.total_memory))
        if torch.version.hip:
            arch = getattr(p, "gcnArchName", None)
            props["capability"] = arch
            props["bf16"] = bool(torch.cuda.is_bf16_supported())
            props["fp16"] = True
            props["fp8"] = bool(arch and arch.startswith(("gfx94", "gfx95", "gfx12")))
        else:
            cc = (p.major, p.minor)
            props.update(
                capability=f"{p.major}.{p.minor}",
                bf16=cc >= (8, 0),
                fp16=cc >= (6, 0),
                fp8=cc >= (8, 9),
            )
    elif device_type == "xpu":
        p = torch.xpu.get_device_properties(index)
        props.update(name=p.name, memory_bytes=int(p.total_memory), fp16=True)
        props["bf16"] = bool(torch.xpu.is_bf16_supported())
        props["unknown"]["capability"] = "XPU exposes no compute capability"
        props["unknown"]["fp8"] = "no torch API reports fp8 support on XPU"
    elif device_type == "mps":
        props.update(name="Apple MPS", fp16=True, fp8=False)
        if hasattr(torch.mps, "recommended_max_memory"):
            props["memory_bytes"] = int(torch.mps.recommended_max_memory())
        props["bf16"] = bool(torch.backends.mps.is_macos_or_newer(14, 0))
        props["unknown"]["capability"] = "MPS exposes no compute capability"
    else:
        props["unknown"]["name"] = f"no property API known for {device_type}"
    return props


def probe(device_type: str, indices: list[int], timeout: float | None = None) -> dict[str, dict]:
    """First-touch every ``device_type:i`` in parallel children; never blocks past ``timeout``.

    Returns ``{"cuda:0": {"usable": bool, "problem": str|None, "seconds": float, ...props}}``.
    """
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    todo = [i for i in indices if f"{device_type}:{i}" not in _cache]
    children = {}
    start = time.monotonic()
    for i in todo:
        # This file runs as a plain script (stdlib imports only), so the child
        # imports nothing before the device touch but torch itself.
        children[i] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), device_type, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for i, proc in children.items():
        key = f"{device_type}:{i}"
        left = max(0.1, timeout - (time.monotonic() - start))
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            _cache[key] = {
                "usable": False,
                "problem": f"probe timed out after {timeout:g} s (first allocation and kernel "
                "never returned; typical of a device whose kernels are JIT-compiled at first use)",
                "seconds": round(time.monotonic() - start, 2),
            }
            log.warning("%s: %s", key, _cache[key]["problem"])
            continue
        seconds = round(time.monotonic() - start, 2)
        result = _parse(out)
        if proc.returncode == 0 and result is not None:
            _cache[key] = {"usable": True, "problem": None, "seconds": seconds, **result}
        else:
            last = (err or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            _cache[key] = {
                "usable": False,
                "problem": f"probe failed (exit code {proc.returncode}): {last[0]}",
                "seconds": seconds,
            }
            log.warning("%s: %s", key, _cache[key]["problem"])
    return {f"{device_type}:{i}": _cache[f"{device_type}:{i}"] for i in indices}


def _parse(out: str) -> dict | None:
    for line in reversed((out or "").strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def clear_cache() -> None:
    _cache.clear()


if __name__ == "__main__":
    _child_main(sys.argv[1], int(sys.argv[2]))
