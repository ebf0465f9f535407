"""Each instance's environment and command, from a layout and the machine's facts (a `Host`).

Per instance: OMP_NUM_THREADS and the OpenMP affinity variables for its slice (bind.omp_env), the
allocator (and libiomp5 for --omp intel) in LD_PRELOAD when found, and the binding: through
`numactl --physcpubind --membind` when numactl exists and may bind memory here, else the child's own
affinity mask (set between fork and exec by supervise.py). A variable already in the environment is
kept, with a note: the user's setting wins, as with torch's run_cpu.

Nothing here starts a process but the numactl probe of `detect_host`; tests build a Host by hand.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import bind, omp, preload
from .layout import Layout
from .torchrun import TorchrunOptions, torchrun_command


@dataclass(frozen=True)
class Host:
    """The facts a launch depends on besides the layout."""

    python: str
    omp: tuple[str, str]  # (kind torch loads, evidence), from omp.detect_omp
    libraries: dict = field(default_factory=dict)  # "tcmalloc"/"jemalloc"/"iomp" -> path or None
    numactl: str | None = None  # a numactl that may bind CPUs and memory here
    numactl_problem: str | None = None  # why there is none, for the notes


@dataclass(frozen=True)
class InstanceLaunch:
    index: int
    cpus: tuple[int, ...]
    node: int | None  # None for the torchrun process (its ranks each have one)
    env: dict  # variables set or changed for this process; the rest is inherited
    command: tuple[str, ...]
    bind: str  # "numactl" | "affinity" (set in the child) | "bind.py" (torchrun: per rank)


@dataclass(frozen=True)
class LaunchPlan:
    mode: str  # "instances" | "torchrun"
    layout: Layout
    omp: str  # "gnu" | "intel": which variables are set
    omp_detected: str  # what torch loads, and how we know
    allocator: str | None  # "tcmalloc" | "jemalloc" | None (the C library's malloc)
    preload: tuple[str, ...]
    numactl: str | None
    notes: tuple[str, ...]
    processes: tuple[InstanceLaunch, ...]  # torchrun mode: one, the torchrun process

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _probe_numactl(exe: str, cpu: int, node: int) -> str | None:
    """None when `numactl --physcpubind --membind` works here, else why not. Containers started without
    CAP_SYS_NICE (Docker's default seccomp profile) refuse set_mempolicy, so presence is not enough."""
    cmd = [exe, f"--physcpubind={cpu}", f"--membind={node}", shutil.which("true") or "/bin/true"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{exe} could not run: {e}"
    if out.returncode != 0:
        first = (out.stderr or out.stdout).strip().splitlines()[:1]
        return f"{' '.join(cmd[:3])} failed here: {first[0] if first else 'exit ' + str(out.returncode)}"
    return None


def detect_host(layout: Layout, numa_nodes: int = 1,
                want: tuple[str, ...] = ("tcmalloc", "jemalloc", "iomp")) -> Host:
    numactl, problem = shutil.which("numactl"), None
    if numactl is None:
        # With one node there is no memory to bind: the affinity mask does the same job, quietly.
        if numa_nodes > 1:
            problem = "numactl not found (apt install numactl); memory is not bound to the instance's node"
    elif layout.instances:
        first = layout.instances[0]
        problem = _probe_numactl(numactl, first.cpus[0], first.node)
        numactl = None if problem else numactl
    libraries = {k: preload.find_library(k) for k in want}
    return Host(python=sys.executable, omp=omp.detect_omp(), libraries=libraries, numactl=numactl,
                numactl_problem=problem)


def _choose_allocator(requested: str, libraries: Mapping) -> tuple[str | None, list[str]]:
    if requested == "default":
        return None, []
    if requested == "auto":
        found = next((a for a in preload.ALLOCATORS if libraries.get(a)), None)
        if found is None:
            return None, ["no tcmalloc or jemalloc found, using the C library's malloc "
                          f"(tcmalloc: {preload.PACKAGES['tcmalloc']})"]
        return found, []
    if requested not in preload.ALLOCATORS:
        raise ValueError(f"memory_allocator={requested!r}: use auto, jemalloc, tcmalloc or default")
    if not libraries.get(requested):
        return None, [f"--memory-allocator {requested}: not found ({preload.PACKAGES[requested]}); "
                      "running with the C library's malloc"]
    return requested, []


def _merge(wanted: Mapping[str, str], base: Mapping[str, str], notes: list[str]) -> dict[str, str]:
    """The changes to `base`: LD_PRELOAD is prepended to, any other variable the user set is kept."""
    changes = {}
    for key, value in wanted.items():
        have = base.get(key)
        if key == "LD_PRELOAD":
            parts = [p for p in value.split(":") + (have or "").split(":") if p]
            value = ":".join(dict.fromkeys(parts))
        elif have is not None and have != value:
            notes.append(f"{key}={have} is set in your environment and kept (torchkiln would set {value})")
            continue
        if value != have:
            changes[key] = value
    return changes


def build_plan(layout: Layout, script: str, script_args: list[str], host: Host, omp_choice: str = "auto",
               memory_allocator: str = "auto", environ: Mapping[str, str] | None = None,
               torchrun: TorchrunOptions | None = None) -> LaunchPlan:
    if not os.path.isfile(script):
        raise FileNotFoundError(f"script {script!r} does not exist")
    environ = os.environ if environ is None else environ
    notes: list[str] = []
    kind, omp_lib, omp_notes = omp.resolve_omp(omp_choice, host.omp, host.libraries.get("iomp"))
    allocator, alloc_notes = _choose_allocator(memory_allocator, host.libraries)
    notes += omp_notes + alloc_notes
    shared: dict[str, str] = {}
    libs = [p for p in (host.libraries.get(allocator) if allocator else None, omp_lib) if p]
    if libs and not sys.platform.startswith("linux"):
        notes.append("LD_PRELOAD is Linux-only: no allocator or OpenMP library preloaded")
        libs, allocator = [], None
    if libs:
        shared["LD_PRELOAD"] = ":".join(libs)
    if allocator == "jemalloc":
        shared["MALLOC_CONF"] = preload.JEMALLOC_CONF
    if host.numactl is None and host.numactl_problem:
        notes.append(host.numactl_problem + "; binding CPUs with the affinity mask")
    n = len(layout.instances)
    if n and layout.unused:
        notes.append(f"{len(layout.unused)} CPU(s) unused: {bind.format_cpus(layout.unused)}")

    if torchrun is not None:
        if torchrun.nproc_per_node != n:
            raise ValueError(f"nproc_per_node={torchrun.nproc_per_node} but the layout has {n} instances")
        # torchrun sets OMP_NUM_THREADS=1 for every rank unless it is already set; bind.py sets the rest.
        wanted = {**shared, "OMP_NUM_THREADS": str(layout.instances[0].omp_threads)}
        env = _merge(wanted, environ, notes)
        cmd = torchrun_command(host.python, torchrun, layout, kind, host.numactl, script, script_args)
        every = tuple(c for i in layout.instances for c in i.cpus)
        proc = InstanceLaunch(index=0, cpus=every, node=None, env=env, command=tuple(cmd), bind="bind.py")
        return _plan("torchrun", layout, kind, host, allocator, libs, notes, (proc,))

    procs = []
    for inst in layout.instances:
        env = _merge({**shared, **bind.omp_env(kind, inst.cpus)}, environ, notes)
        # torchkiln's own numbering always: kept from the environment (a nested run, an exported shell
        # variable), every instance read the same number and did the same share of the work twice
        env.update({"TORCHKILN_INSTANCE": str(inst.index), "TORCHKILN_INSTANCES": str(n)})
        # Output goes through a pipe to be prefixed; unbuffered, lines arrive as they are printed.
        if "PYTHONUNBUFFERED" not in environ:
            env["PYTHONUNBUFFERED"] = "1"
        cmd = [host.python, script, *script_args]
        if host.numactl:
            cpus = bind.format_cpus(inst.cpus)
            cmd = [host.numactl, f"--physcpubind={cpus}", f"--membind={inst.node}", *cmd]
        procs.append(InstanceLaunch(index=inst.index, cpus=inst.cpus, node=inst.node, env=env,
                                    command=tuple(cmd), bind="numactl" if host.numactl else "affinity"))
    return _plan("instances", layout, kind, host, allocator, libs, notes, tuple(procs))


def _plan(mode, layout, kind, host, allocator, libs, notes, procs) -> LaunchPlan:
    return LaunchPlan(mode=mode, layout=layout, omp=kind, omp_detected=f"{host.omp[0]}, {host.omp[1]}",
                      allocator=allocator, preload=tuple(libs), numactl=host.numactl,
                      notes=tuple(dict.fromkeys(notes)), processes=tuple(procs))
