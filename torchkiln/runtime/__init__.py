"""The CPU runtime: running a script on chosen cores, the way `ipexrun` and
`python -m torch.backends.xeon.run_cpu` do, on any vendor's CPU.

    layout.py     which cores each instance gets (never across NUMA nodes)
    launch.py     each instance's environment and command: OpenMP, allocator preload, numactl
    omp.py        which OpenMP runtime torch loads, and what --omp picks
    preload.py    finding jemalloc / tcmalloc / libiomp5 for LD_PRELOAD
    torchrun.py   the torchrun command of `--nproc-per-node` mode
    bind.py       per-rank binding under torchrun (run by path: imports only the standard library)
    supervise.py  running the instances: prefixed output, log files, signals, exit codes
    command.py    the `torchkiln run` subcommand
    pool.py       tk.runtime.CPUPool and pin(): torch work on chosen cores, in-process
    streams.py    tk.runtime.MultiStreamModule and Task: calls on pinned threads of their own
    allocator.py  glibc malloc keeps freed memory (CPU training's plan; process-wide, set once)
    timed.py      tk.runtime.measure: a benchmark's timed window, shared by the instances of a layout
    tuning.py     `torchkiln run --autotune` / tk.runtime.autotune: measure layouts, save the best as JSON,
                  `--layout FILE` reads it back (re-planned when tuned on another machine)

The machine's topology comes from `torchkiln.hardware.topology`. pool.py and streams.py import
torch; they load on first use, so the launcher stays fast.
"""

_LAZY = {"CPUPool": ".pool", "pin": ".pool", "MultiStreamModule": ".streams", "Task": ".streams",
         "measure": ".timed", "autotune": ".tuning"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'torchkiln.runtime' has no attribute {name!r}")
