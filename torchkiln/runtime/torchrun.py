"""The torchrun command of `torchkiln run --nproc-per-node K`.

torchrun starts the K local ranks itself and has no per-rank CPU binding (its `--numa-binding` is
newer than torch 2.6, binds whole nodes and is meant for GPU hosts), so its script is bind.py, which
gives rank LOCAL_RANK the LOCAL_RANK-th slice of the layout and then runs the user's script.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import bind
from .layout import Layout

BIND_SCRIPT = str(Path(bind.__file__).resolve())


@dataclass(frozen=True)
class TorchrunOptions:
    nproc_per_node: int
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None  # HOST:PORT of rank 0's node; torchrun's static rendezvous
    log_dir: str | None = None


def torchrun_command(python: str, opts: TorchrunOptions, layout: Layout, omp: str, numactl: str | None,
                     script: str, script_args: list[str]) -> list[str]:
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={opts.nproc_per_node}"]
    if opts.nnodes is not None:
        cmd.append(f"--nnodes={opts.nnodes}")
    if opts.node_rank is not None:
        cmd.append(f"--node-rank={opts.node_rank}")
    if opts.rdzv_endpoint:
        cmd.append(f"--rdzv-endpoint={opts.rdzv_endpoint}")
    if opts.log_dir:
        # torchrun writes per-rank files under LOG_DIR/<run id>/; --tee 3 keeps them on the console too.
        cmd += [f"--log-dir={opts.log_dir}", "--tee=3"]
    slices = bind.format_slices((inst.cpus, inst.node) for inst in layout.instances)
    cmd += [BIND_SCRIPT, f"--slices={slices}", f"--omp={omp}"]
    if numactl:
        cmd.append(f"--numactl={numactl}")
    return [*cmd, "--", script, *script_args]
