"""CPU facts from /proc/cpuinfo, lscpu and sysfs.

The parsers take text, not paths, so tests feed them captured output from
machines we do not have (an AMX Xeon, a Zen server, an Arm Neoverse).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from .model import CPUInfo

# /proc/cpuinfo flag -> torchkiln feature name. Only the flags that change
# which kernels are fast; the full flag list is noise for planning.
_X86_FLAGS = {
    "avx2": "avx2",
    "fma": "fma",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512_vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni",
    "avx512_bf16": "avx512_bf16",
    "avx512_fp16": "avx512_fp16",
    "amx_tile": "amx_tile",
    "amx_bf16": "amx_bf16",
    "amx_int8": "amx_int8",
    "amx_fp16": "amx_fp16",
}
_ARM_FLAGS = {
    "asimd": "neon",
    "asimdhp": "neon_fp16",
    "sve": "sve",
    "sve2": "sve2",
    "bf16": "bf16",
    "svebf16": "sve_bf16",
    "i8mm": "i8mm",
    "svei8mm": "sve_i8mm",
    "asimddp": "dotprod",
}
# Arm "CPU implementer" codes, for a readable vendor when lscpu is absent.
_ARM_IMPLEMENTERS = {
    "0x41": "ARM",
    "0x42": "Broadcom",
    "0x43": "Cavium",
    "0x46": "Fujitsu",
    "0x48": "HiSilicon",
    "0x4e": "NVIDIA",
    "0x50": "Ampere",
    "0x51": "Qualcomm",
    "0x61": "Apple",
    "0xc0": "Ampere",
}


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def parse_cpuinfo(text: str) -> dict:
    """Parse /proc/cpuinfo into vendor, model, features, logical/physical cores, sockets."""
    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    procs = []
    for block in blocks:
        d = {}
        for line in block.splitlines():
            if ":" in line:
                k, _, v = line.partition(":")
                d[k.strip().lower()] = v.strip()
        procs.append(d)
    first = next((p for p in procs if "processor" in p), procs[0] if procs else {})
    out: dict = {"logical_cores": sum(1 for p in procs if "processor" in p) or None}
    flags = (first.get("flags") or first.get("features") or "").split()
    is_arm = "features" in first and "flags" not in first
    table = _ARM_FLAGS if is_arm else _X86_FLAGS
    out["features"] = tuple(sorted({table[f] for f in flags if f in table}))
    out["arch"] = "aarch64" if is_arm else ("x86_64" if flags else None)
    if is_arm:
        impl = first.get("cpu implementer", "").lower()
        out["vendor"] = _ARM_IMPLEMENTERS.get(impl, impl or None)
        out["model"] = first.get("model name") or (
            f"part {first['cpu part']}" if "cpu part" in first else None
        )
    else:
        out["vendor"] = first.get("vendor_id")
        out["model"] = first.get("model name")
    pairs = {(p.get("physical id"), p.get("core id")) for p in procs if "core id" in p}
    out["physical_cores"] = len(pairs) or None
    sockets = {p.get("physical id") for p in procs if "physical id" in p}
    out["sockets"] = len(sockets) or None
    return out


def parse_lscpu(text: str) -> dict:
    """Parse plain `lscpu` output (the human form is stable across util-linux versions)."""
    kv = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            kv[k.strip().lower()] = v.strip()

    def num(key):
        v = kv.get(key)
        return int(v) if v and v.isdigit() else None

    out = {
        "vendor": kv.get("vendor id"),
        "model": kv.get("model name"),
        "sockets": num("socket(s)"),
        "numa_nodes": num("numa node(s)"),
        "logical_cores": num("cpu(s)"),
    }
    per_socket, per_cluster = num("core(s) per socket"), num("core(s) per cluster")
    per = per_socket or per_cluster
    n_groups = out["sockets"] or num("cluster(s)") or 1
    out["physical_cores"] = per * n_groups if per else None
    flags = kv.get("flags", "").split()
    if flags:
        table = _ARM_FLAGS if kv.get("architecture") == "aarch64" else _X86_FLAGS
        out["features"] = tuple(sorted({table[f] for f in flags if f in table}))
    return {k: v for k, v in out.items() if v is not None}


def _numa_nodes_from_sysfs() -> int | None:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return len(nodes) or None


def _meminfo_bytes(text: str | None) -> int | None:
    m = re.search(r"^MemTotal:\s+(\d+)\s+kB", text or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def _run_lscpu() -> str | None:
    exe = shutil.which("lscpu")
    if not exe:
        return None
    try:
        # LC_ALL=C: lscpu translates its labels, and we parse the English ones.
        env = {**os.environ, "LC_ALL": "C"}
        return subprocess.run([exe], capture_output=True, text=True, timeout=5, env=env).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def build_cpu_info(
    cpuinfo: str | None, lscpu: str | None, meminfo: str | None, numa_nodes: int | None = None
) -> CPUInfo:
    """Merge the sources; lscpu wins for topology, cpuinfo for features."""
    facts: dict = {}
    if cpuinfo:
        facts.update({k: v for k, v in parse_cpuinfo(cpuinfo).items() if v is not None})
    if lscpu:
        lfacts = parse_lscpu(lscpu)
        for key in ("vendor", "model", "sockets", "numa_nodes", "physical_cores"):
            if key in lfacts:
                facts[key] = lfacts[key]
        if not facts.get("features") and "features" in lfacts:
            facts["features"] = lfacts["features"]
        facts.setdefault("logical_cores", lfacts.get("logical_cores"))
    if numa_nodes and "numa_nodes" not in facts:
        facts["numa_nodes"] = numa_nodes
    facts["memory_bytes"] = _meminfo_bytes(meminfo)
    if facts.get("vendor") == "ARM" and facts.get("model") in (None, "-"):
        facts["model"] = None
    reasons = {}
    for key, why in (
        ("vendor", "no vendor_id in /proc/cpuinfo or lscpu"),
        ("model", "no model name in /proc/cpuinfo or lscpu"),
        ("physical_cores", "no core ids in /proc/cpuinfo and no lscpu"),
        ("logical_cores", "/proc/cpuinfo unreadable"),
        ("sockets", "no physical ids in /proc/cpuinfo and no lscpu"),
        ("numa_nodes", "no NUMA line in lscpu and no /sys/devices/system/node"),
        ("memory_bytes", "/proc/meminfo unreadable"),
        ("arch", "unknown architecture"),
    ):
        if facts.get(key) is None:
            reasons[key] = why
    return CPUInfo(
        arch=facts.get("arch") or platform.machine() or None,
        vendor=facts.get("vendor"),
        model=facts.get("model"),
        physical_cores=facts.get("physical_cores"),
        logical_cores=facts.get("logical_cores"),
        sockets=facts.get("sockets"),
        numa_nodes=facts.get("numa_nodes"),
        memory_bytes=facts.get("memory_bytes"),
        features=tuple(facts.get("features", ())),
        unknown=reasons,
    )


def detect_cpu() -> CPUInfo:
    info = build_cpu_info(
        _read("/proc/cpuinfo"), _run_lscpu(), _read("/proc/meminfo"), _numa_nodes_from_sysfs()
    )
    if info.memory_bytes is None or info.physical_cores is None:
        info = _fill_from_psutil(info)
    return info


def _fill_from_psutil(info: CPUInfo) -> CPUInfo:
    """Off Linux (macOS, Windows) /proc is missing; psutil still knows cores and memory."""
    try:
        import psutil
    except ImportError:
        return info
    from dataclasses import replace

    unknown = dict(info.unknown)
    mem = info.memory_bytes or psutil.virtual_memory().total
    phys = info.physical_cores or psutil.cpu_count(logical=False)
    logical = info.logical_cores or psutil.cpu_count(logical=True)
    for key, val in (("memory_bytes", mem), ("physical_cores", phys), ("logical_cores", logical)):
        if val is not None:
            unknown.pop(key, None)
    return replace(info, memory_bytes=mem, physical_cores=phys, logical_cores=logical, unknown=unknown)
