"""`torchkiln run`: run a script on chosen cores, one or more instances, or under torchrun.

Importing this file imports no torch: the launcher itself needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from .bind import format_cpus

_EPILOG = """examples:
  torchkiln run --dry-run --instances 2 infer.py --batch 8   show the plan, start nothing
  torchkiln run --cores-per-instance 4 --log-dir logs infer.py
  torchkiln run --nproc-per-node 2 train.py                   torchrun, each rank on its own cores
  torchkiln run --autotune --save best.json bench.py          measure layouts, keep the fastest
  torchkiln run --layout best.json infer.py                   run with the tuned layout
see docs/runtime.md"""


def register(sub, common) -> None:
    r = sub.add_parser(
        "run", parents=[common], epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run a script pinned to cores: instances, NUMA, OpenMP, allocator (ipexrun's successor)",
        description="Run SCRIPT in one or more instances, each bound to its own cores and NUMA node, "
                    "with OpenMP and allocator settings to match.")
    lay = r.add_argument_group("layout (default: one instance per NUMA node, all allowed physical cores)")
    lay.add_argument("--instances", type=int, help="how many copies of the script to run")
    lay.add_argument("--cores-per-instance", type=int, help="cores for each instance")
    lay.add_argument("--node-id", type=int, help="use only this NUMA node's cores")
    lay.add_argument("--use-logical-cores", action="store_true", help="count hyperthreads (SMT siblings) too")
    env = r.add_argument_group("environment")
    env.add_argument("--memory-allocator", choices=["auto", "tcmalloc", "jemalloc", "default"],
                     default="auto", help="preload this allocator when found "
                                          "(auto: tcmalloc, else jemalloc, else the C library's)")
    env.add_argument("--omp", choices=["auto", "gnu", "intel"], default="auto",
                     help="OpenMP affinity variables to set (auto: for the runtime torch loads)")
    lay.add_argument("--layout", metavar="FILE", help="use the layout a --autotune run saved (re-planned "
                                                      "with a warning when tuned on another machine)")
    tune = r.add_argument_group("autotune (measure layouts with SCRIPT, a short benchmark that calls "
                                "tk.runtime.measure; save the best)")
    tune.add_argument("--autotune", action="store_true", help="time SCRIPT under several layouts and save the "
                                                               "best")
    tune.add_argument("--autotune-instances", metavar="K,K,...",
                      help="instance counts to try (default: 1 instance on a node, then slices of 1/2, 1/4, ... "
                           "of a node down to 1 core, as many as fit)")
    tune.add_argument("--autotune-seconds", type=float, default=3.0, help="timed window per layout (3)")
    tune.add_argument("--autotune-rounds", type=int, default=1, help="rounds, layouts interleaved; median (1)")
    tune.add_argument("--autotune-goal", choices=["throughput", "latency"], default="throughput",
                      help="what the best layout maximises: items/s over all instances, or the fastest call")
    tune.add_argument("--save", metavar="FILE", default="torchkiln-layout.json",
                      help="where --autotune writes its choice (default torchkiln-layout.json)")
    tune.add_argument("--force", action="store_true", help="let --autotune replace an existing --save file")
    r.add_argument("--log-dir", help="also write instance i's output to LOG_DIR/instance_i.log")
    r.add_argument("--dry-run", action="store_true", help="print the plan, each instance's environment and "
                                                          "command, and start nothing")
    tr = r.add_argument_group("torchrun mode (distributed: one process per rank, each on its own cores)")
    tr.add_argument("--nproc-per-node", type=int, help="ranks on this node")
    tr.add_argument("--nnodes", type=int, help="nodes in the job")
    tr.add_argument("--node-rank", type=int, help="this node's rank")
    tr.add_argument("--rdzv-endpoint", help="HOST:PORT of node rank 0")
    # One REMAINDER for the script and its arguments: a separate `script` positional would make argparse
    # drop a "--" meant for the script (`run x.py -- a` must pass ["--", "a"]).
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                   help="the Python script and its arguments, passed as given")
    r.set_defaults(func=_cmd_run)


def _torchrun_options(args):
    from .torchrun import TorchrunOptions

    if args.nproc_per_node is None:
        for flag in ("nnodes", "node_rank", "rdzv_endpoint"):
            if getattr(args, flag) is not None:
                flag = "--" + flag.replace("_", "-")
                raise ValueError(f"{flag} is a torchrun-mode option: add --nproc-per-node K")
        return None
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node {args.nproc_per_node}: must be a positive integer")
    if args.instances is not None and args.instances != args.nproc_per_node:
        raise ValueError(f"--instances {args.instances} with --nproc-per-node {args.nproc_per_node}: "
                         "torchrun mode runs one instance per rank; drop --instances")
    return TorchrunOptions(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
                           rdzv_endpoint=args.rdzv_endpoint, log_dir=args.log_dir)


def _cmd_run(args) -> int:
    from ..hardware.topology import detect_topology
    from .launch import build_plan, detect_host
    from .layout import plan_layout
    from .supervise import run_processes

    command = args.command[1:] if args.command[:1] == ["--"] else args.command  # `run [options] -- x.py`
    if not command:
        raise ValueError("no script given: torchkiln run [options] SCRIPT [ARGS ...]")
    script, script_args = command[0], command[1:]
    torchrun = _torchrun_options(args)
    if os.path.isdir(script):
        raise ValueError(f"script {script!r} is a folder; give the Python file to run, e.g. {script}/train.py")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"script {script!r} does not exist")
    topology = detect_topology()
    if args.autotune:
        return _cmd_autotune(args, topology, script, script_args, torchrun)
    chosen = dict(instances=torchrun.nproc_per_node if torchrun else args.instances,
                  cores_per_instance=args.cores_per_instance, node_id=args.node_id,
                  use_logical_cores=args.use_logical_cores)
    if args.layout:
        if args.instances or args.cores_per_instance or args.node_id is not None or torchrun:
            raise ValueError("--layout FILE sets the layout: drop --instances, --cores-per-instance, --node-id "
                             "and --nproc-per-node")
        from .tuning import load_layout

        tuned, why = load_layout(args.layout, topology)
        if why:
            print(f"torchkiln run: warning: {why}", file=sys.stderr, flush=True)
        chosen = tuned or dict(use_logical_cores=args.use_logical_cores)
    # the messages name the options typed, not plan_layout's keywords (`instances=49` read as a Python
    # call: the CLI probe, 2026-11-26)
    options = {"instances": "--nproc-per-node" if torchrun else "--instances",
               "cores_per_instance": "--cores-per-instance", "node_id": "--node-id",
               "use_logical_cores": "--use-logical-cores"}
    layout = plan_layout(topology, **chosen, options=options)
    host = detect_host(layout, numa_nodes=len(topology.nodes()))
    plan = build_plan(layout, script, script_args, host, omp_choice=args.omp,
                      memory_allocator=args.memory_allocator, torchrun=torchrun)
    if args.dry_run:
        print(json.dumps(plan.to_dict(), indent=2) if args.json else describe(plan))
        return 0
    # The plan goes to stderr, so stdout carries only the script's own (prefixed) output.
    shown = json.dumps(plan.to_dict()) if args.json else describe(plan, details=False)
    print(shown, file=sys.stderr, flush=True)
    codes = run_processes(plan.processes, log_dir=None if torchrun else args.log_dir, prefix=torchrun is None)
    worst = max(codes)
    if len(codes) > 1:
        print(f"torchkiln run: exit codes {codes}; returning {worst}", file=sys.stderr)
    return worst


def _cmd_autotune(args, topology, script, script_args, torchrun) -> int:
    from .tuning import tune

    if torchrun or args.layout or args.instances or args.cores_per_instance:
        raise ValueError("--autotune chooses the layout itself: drop --instances, --cores-per-instance, "
                         "--layout and --nproc-per-node (--autotune-instances 1,2 limits what it tries)")
    if os.path.isdir(args.save):
        raise ValueError(f"--save {args.save!r} is a folder; give a file name (e.g. "
                         f"{os.path.join(args.save, 'torchkiln-layout.json')})")
    if os.path.exists(args.save) and not args.force:
        raise FileExistsError(f"--save {args.save!r} exists; pass --force to replace it or --save another file")
    parent = os.path.dirname(os.path.abspath(args.save))
    if not os.path.isdir(parent):  # checked before the tuning, not after it (all of it lost)
        raise ValueError(f"--save {args.save!r}: its folder {parent!r} does not exist")
    counts = None
    if args.autotune_instances:
        try:
            counts = [int(k) for k in args.autotune_instances.split(",") if k.strip()]
        except ValueError:
            raise ValueError(f"--autotune-instances {args.autotune_instances!r}: use counts like 1,2,4") from None
        bad = [k for k in counts if k < 1]
        if bad or not counts:
            raise ValueError(f"--autotune-instances {args.autotune_instances!r}: counts must be positive")
    tuned = tune(script, script_args, topology, instances=counts, node_id=args.node_id,
                 use_logical_cores=args.use_logical_cores, seconds=args.autotune_seconds,
                 rounds=args.autotune_rounds, goal=args.autotune_goal, omp_choice=args.omp,
                 memory_allocator=args.memory_allocator, show_progress=not args.json)
    tuned.save(args.save, overwrite=args.force)
    if args.json:
        print(json.dumps(tuned.to_dict(), indent=2))
    else:
        best = tuned.best
        print(tuned.table())
        print(f"best for {tuned.goal}: {best['instances']} x {best['cores_per_instance']} cores; saved to "
              f"{args.save}\nrun it with: torchkiln run --layout {args.save} SCRIPT [ARGS ...]")
    return 0


def describe(plan, details: bool = True) -> str:
    """The plan as the dry run prints it: settings, then per process its changed variables and command
    (`details`; a real run prints only the slices)."""
    layout = plan.layout
    head = f"torchkiln run (torchrun, one rank per slice): {layout.rule}" if plan.mode == "torchrun" else (
        f"torchkiln run: {layout.rule}")
    binding = f"numactl ({plan.numactl})" if plan.numactl else "affinity mask (no usable numactl)"
    lines = [
        head,
        f"  OpenMP    {plan.omp} variables; torch's runtime: {plan.omp_detected}",
        f"  allocator {plan.allocator or 'the C library malloc'}"
        + (f", LD_PRELOAD={':'.join(plan.preload)}" if plan.preload else ""),
        f"  binding   {binding}",
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    if plan.mode == "torchrun":
        lines += [f"rank {i.index}: node {i.node}, cpus {format_cpus(i.cpus)}" for i in layout.instances]
        lines.append("torchrun starts the ranks, bind.py binds each to its slice")
    for proc in plan.processes:
        if plan.mode == "instances":
            cpus = format_cpus(proc.cpus)
            lines.append(f"instance {proc.index}: node {proc.node}, cpus {cpus}, bound by {proc.bind}")
        if details:
            lines += [f"    {k}={shlex.quote(v)}" for k, v in proc.env.items()]
            lines.append(f"    $ {shlex.join(proc.command)}")
    return "\n".join(lines)
