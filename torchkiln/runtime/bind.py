"""Bind a process to one CPU slice, and the OpenMP variables that go with a slice.

As a program it is torchrun's per-rank entry: torchrun starts every local rank with the same command
and has no per-rank CPU binding, so `torchkiln run --nproc-per-node K` gives torchrun this file,

    python .../torchkiln/runtime/bind.py --slices 0-3@0/4-7@1 --omp gnu [--numactl PATH] -- script.py ARGS

and rank LOCAL_RANK takes slice number LOCAL_RANK (`CPUS@NODE`, slices separated by "/"): it sets the
slice's OpenMP variables, binds (through numactl, exec'd, when given; else its own affinity mask) and
runs the script as `python script.py ARGS` would.

It is run by path, never `-m torchkiln...`, and imports only the standard library: importing the
torchkiln package imports torch, and libgomp reads OMP_NUM_THREADS and GOMP_CPU_AFFINITY once, when
torch loads it. launch.py imports `omp_env` from here, so both paths set the same variables.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def format_cpus(cpus) -> str:
    """Ascending CPUs as the kernel's list syntax, which numactl and GOMP_CPU_AFFINITY read: 0-3,8."""
    cpus = sorted(cpus)
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts)


def parse_cpus(text: str) -> list[int]:
    # Same syntax as hardware.topology.parse_cpu_list, repeated to keep this file standard-library only.
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_slices(slices) -> str:
    return "/".join(f"{format_cpus(cpus)}@{node}" for cpus, node in slices)


def parse_slices(text: str) -> list[tuple[list[int], int]]:
    out = []
    for item in text.split("/"):
        cpus, _, node = item.partition("@")
        out.append((parse_cpus(cpus), int(node or 0)))
    return out


def omp_env(omp: str, cpus) -> dict[str, str]:
    """OpenMP variables for one slice. `omp` is "gnu" (libgomp) or "intel" (libiomp5, LLVM libomp)."""
    env = {"OMP_NUM_THREADS": str(len(cpus))}
    if omp == "gnu":
        # Thread i on the i-th CPU of the slice. OMP_PROC_BIND=close makes the binding explicit; libgomp
        # then takes its places from GOMP_CPU_AFFINITY (OMP_PLACES, if set, would win over it).
        env["GOMP_CPU_AFFINITY"] = format_cpus(cpus)
        env["OMP_PROC_BIND"] = "close"
    elif omp == "intel":
        # compact,1,0: one thread per physical core first, then the siblings, within the process's
        # mask (the slice, set by numactl or the affinity call); blocktime 1 ms stops idle threads
        # spinning on cores another instance needs. The values ipexrun and run_cpu use.
        env["KMP_AFFINITY"] = "granularity=fine,compact,1,0"
        env["KMP_BLOCKTIME"] = "1"
    else:
        raise ValueError(f"omp={omp!r}: use 'gnu' or 'intel'")
    return env


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bind.py", description="bind this local rank to its CPU slice, "
                                                               "then run a script")
    p.add_argument("--slices", required=True, help="CPUS@NODE per local rank, separated by /")
    p.add_argument("--omp", choices=["gnu", "intel"], default="gnu")
    p.add_argument("--numactl", help="numactl to exec through (also binds memory to the node)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py ARGS")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no script given after --")
    slices = parse_slices(args.slices)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rank >= len(slices):
        sys.exit(f"bind.py: LOCAL_RANK={rank} but only {len(slices)} CPU slices were planned "
                 f"({args.slices}); torchrun's --nproc-per-node must equal the number of slices")
    cpus, node = slices[rank]
    # A value already in the environment wins, as everywhere in `torchkiln run`; the launcher sets
    # OMP_NUM_THREADS for torchrun so torchrun does not force it to 1.
    for key, value in omp_env(args.omp, cpus).items():
        os.environ.setdefault(key, value)
    script, *script_args = command
    if args.numactl:
        os.execv(args.numactl, [args.numactl, f"--physcpubind={format_cpus(cpus)}", f"--membind={node}",
                                sys.executable, script, *script_args])
    os.sched_setaffinity(0, cpus)
    sys.argv = [script, *script_args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would have it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
