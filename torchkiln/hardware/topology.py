"""Where each logical CPU this process may use sits: its physical core, socket and NUMA node.

`torchkiln run` plans core slices from this. Read from `lscpu -p` (one line per CPU), else sysfs,
else assumed flat (one core per CPU, one node). The parsers take text or a root folder, so tests
feed them machines we do not have.

Only the CPUs in the process's affinity mask (taskset, cgroup cpusets, numactl) are kept: a
launcher that hands out a CPU the process may not use would fail at bind time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LogicalCPU", "Topology", "detect_topology", "parse_cpu_list", "parse_lscpu_p", "read_sysfs"]


@dataclass(frozen=True)
class LogicalCPU:
    cpu: int  # the kernel's CPU number: what affinity masks, numactl and OpenMP use
    core: int  # physical core id; unique within its socket (lscpu numbers them machine-wide)
    socket: int
    node: int  # NUMA node; 0 where the machine reports none
    first_thread: bool  # the lowest-numbered allowed CPU of its physical core


@dataclass(frozen=True)
class Topology:
    cpus: tuple[LogicalCPU, ...]  # allowed CPUs only, ascending
    source: str = "lscpu"  # "lscpu", "sysfs" or "flat" (nothing known: one core per CPU, one node)

    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({c.node for c in self.cpus}))

    def physical(self) -> tuple[LogicalCPU, ...]:
        return tuple(c for c in self.cpus if c.first_thread)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's list syntax, as in sysfs cpulist files: "0-3,8,10-11"."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _build(rows: Iterable[tuple[int, int, int, int]], allowed: set[int] | None, source: str) -> Topology:
    rows = sorted(r for r in rows if allowed is None or r[0] in allowed)
    first: dict[tuple[int, int], int] = {}
    for cpu, core, socket, _ in rows:
        first.setdefault((socket, core), cpu)
    cpus = tuple(
        LogicalCPU(cpu=cpu, core=core, socket=socket, node=node, first_thread=first[(socket, core)] == cpu)
        for cpu, core, socket, node in rows
    )
    return Topology(cpus=cpus, source=source)


def parse_lscpu_p(text: str, allowed: set[int] | None = None) -> Topology:
    """Parse `lscpu -p=CPU,CORE,SOCKET,NODE`. Empty fields (no NUMA, some VMs) become 0, or the CPU
    number for the core, so such a CPU counts as its own core."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        cpu = int(fields[0])
        core, socket, node = (int(f) if f.isdigit() else None for f in fields[1:4])
        rows.append((cpu, cpu if core is None else core, socket or 0, node or 0))
    return _build(rows, allowed, "lscpu")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def read_sysfs(root: str | Path = "/sys/devices/system", allowed: set[int] | None = None) -> Topology:
    """The same facts from sysfs, for machines without lscpu (minimal containers)."""
    root = Path(root)
    node_of: dict[int, int] = {}
    for node_dir in root.glob("node/node[0-9]*"):
        try:
            listed = parse_cpu_list((node_dir / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        for cpu in listed:
            node_of[cpu] = int(node_dir.name[4:])
    try:
        online = set(parse_cpu_list((root / "cpu" / "online").read_text()))
    except (OSError, ValueError):
        online = None
    rows = []
    for cpu_dir in root.glob("cpu/cpu[0-9]*"):
        if not re.fullmatch(r"cpu\d+", cpu_dir.name):
            continue
        cpu = int(cpu_dir.name[3:])
        if online is not None and cpu not in online:
            continue
        core = _read_int(cpu_dir / "topology" / "core_id")
        socket = _read_int(cpu_dir / "topology" / "physical_package_id")
        # Some Arm firmware reports package -1: treat it as one socket.
        socket = socket if socket is not None and socket >= 0 else 0
        rows.append((cpu, cpu if core is None else core, socket, node_of.get(cpu, 0)))
    return _build(rows, allowed, "sysfs")


def _run_lscpu_p() -> str | None:
    exe = shutil.which("lscpu")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "-p=CPU,CORE,SOCKET,NODE"], capture_output=True, text=True, timeout=5,
                             env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on; None where the OS cannot say (macOS, Windows)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return set(getaffinity(0)) if getaffinity else None


def detect_topology(allowed: set[int] | None = None) -> Topology:
    """This machine's topology, restricted to `allowed` (default: this process's affinity mask)."""
    allowed = allowed_cpus() if allowed is None else allowed
    text = _run_lscpu_p()
    if text:
        topo = parse_lscpu_p(text, allowed)
        if topo.cpus:
            return topo
    topo = read_sysfs(allowed=allowed)
    if topo.cpus:
        return topo
    cpus = sorted(allowed) if allowed else range(os.cpu_count() or 1)
    return _build(((c, c, 0, 0) for c in cpus), None, "flat")
