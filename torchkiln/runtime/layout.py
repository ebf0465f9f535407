"""Which CPUs each instance gets.

Rules:
- physical cores only (the first allowed thread of each core) unless `use_logical_cores`;
- an instance never spans NUMA nodes: its threads would pay remote-memory latency and cross-socket
  barriers on every parallel region, which usually costs more than the extra cores give;
- no CPU goes to two instances; with `instances` or `cores_per_instance` all get the same number;
- with neither `instances` nor `cores_per_instance`: one instance on all allowed cores when they lie in
  one NUMA node, else one instance per node (each with its node's cores). This is torch's
  `run_cpu --throughput-mode` and the only way to use every core without spanning a node; the
  instances can tell themselves apart by $TORCHKILN_INSTANCE. `node_id` keeps a single node;
- with `instances` only: the largest equal slice that gives that many instances, nodes filled in
  order; with `cores_per_instance` only: as many instances as fit in each node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from ..hardware.topology import LogicalCPU, Topology

__all__ = ["Instance", "Layout", "plan_layout"]


@dataclass(frozen=True)
class Instance:
    index: int
    cpus: tuple[int, ...]  # ascending
    node: int
    omp_threads: int


@dataclass(frozen=True)
class Layout:
    instances: tuple[Instance, ...]
    use_logical_cores: bool
    rule: str  # why this many instances of this size, in words
    unused: tuple[int, ...] = ()  # CPUs of the counted kind that no instance got

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _namer(options: dict[str, str] | None):
    """How messages name an argument: as the keyword (``instances=49``), or by the caller's option for it
    (the CLI's ``--instances 49``; a keyword set True is the bare flag). Unnamed: ``instances``."""
    def named(key: str, value=None) -> str:
        flag = (options or {}).get(key)
        if flag is None:
            return key if value is None else f"{key}={value!r}"
        return flag if value is None or value is True else f"{flag} {value!r}"
    return named


def _check_positive(what: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{what}: must be a positive integer")


def _pool(topology: Topology, logical: bool) -> dict[int, list[int]]:
    """node -> its CPUs in hand-out order. Logical CPUs go core by core (siblings adjacent), so a slice
    of an even size never splits a core between two instances."""
    first_of_core: dict[tuple[int, int], int] = {}
    for c in topology.cpus:
        first_of_core.setdefault((c.socket, c.core), c.cpu)

    def order(c: LogicalCPU):
        return (first_of_core[(c.socket, c.core)], c.cpu)

    by_node: dict[int, list[int]] = {}
    for c in sorted(topology.cpus, key=order):
        if logical or c.first_thread:
            by_node.setdefault(c.node, []).append(c.cpu)
    return dict(sorted(by_node.items()))


def _slice_size_for(instances: int, sizes: Iterable[int]) -> int:
    """The largest equal slice that yields at least `instances` slices without spanning a node."""
    sizes = list(sizes)
    for size in range(max(sizes), 0, -1):
        if sum(s // size for s in sizes) >= instances:
            return size
    return 1


def plan_layout(topology: Topology, instances: int | None = None, cores_per_instance: int | None = None,
                node_id: int | None = None, use_logical_cores: bool = False,
                options: dict[str, str] | None = None) -> Layout:
    """``options``: the caller's name for each argument, for the messages (the CLI: {"instances":
    "--instances", ...}); by default they name the keywords."""
    named = _namer(options)
    _check_positive(named("instances", instances), instances)
    _check_positive(named("cores_per_instance", cores_per_instance), cores_per_instance)
    kind = "logical CPUs" if use_logical_cores else "physical cores"
    by_node = _pool(topology, use_logical_cores)
    if not by_node:
        raise ValueError("no CPUs to run on: this process's affinity mask is empty")
    if node_id is not None:
        if node_id not in by_node:
            nodes = ", ".join(map(str, by_node))
            raise ValueError(f"{named('node_id', node_id)}: no such NUMA node among the CPUs this process may use; "
                             f"use one of: {nodes}")
        by_node = {node_id: by_node[node_id]}
    sizes = {node: len(cpus) for node, cpus in by_node.items()}
    total = sum(sizes.values())
    where = f" on node {node_id}" if node_id is not None else ""
    if instances is not None and instances > total:
        more = ""
        if not use_logical_cores and len(topology.cpus) > len(topology.physical()):
            more = f" (or {named('use_logical_cores', True)} to count hyperthreads too)"
        raise ValueError(f"{named('instances', instances)}: more instances than the {total} {kind} this process may "
                         f"use{where}; use at most {total}{more}")
    largest = max(sizes.values())
    if cores_per_instance is not None and cores_per_instance > largest:
        biggest = max(sizes, key=sizes.get)
        raise ValueError(f"{named('cores_per_instance', cores_per_instance)}: larger than the largest NUMA node "
                         f"({largest} {kind} on node {biggest}) and an instance never spans nodes; "
                         f"use at most {largest}")

    if instances is None and cores_per_instance is None:
        # One slice per node, each the whole node: sizes may differ when the affinity mask is uneven.
        slices = [(node, cpus) for node, cpus in by_node.items()]
        rule = (f"1 instance on all {total} {kind}{where or ' (one NUMA node)'}" if len(slices) == 1 else
                f"{len(slices)} instances, one per NUMA node ({'/'.join(str(len(c)) for _, c in slices)} {kind}): "
                "an instance never spans nodes; --node-id N keeps one")
        return _layout(slices, by_node, use_logical_cores, rule)

    size = cores_per_instance or _slice_size_for(instances, sizes.values())
    capacity = sum(s // size for s in sizes.values())
    if instances is not None and instances > capacity:
        per_node = ", ".join(f"node {n}: {s}" for n, s in sizes.items())
        fits = _slice_size_for(instances, sizes.values())
        raise ValueError(f"{named('instances', instances)} x {named('cores_per_instance', size)}: only {capacity} such instances "
                         f"fit without spanning a NUMA node ({kind} per node: {per_node}); lower {named('instances')} "
                         f"to {capacity} or {named('cores_per_instance')} to {fits}")
    slices = []
    for node, cpus in by_node.items():
        for start in range(0, len(cpus) - size + 1, size):
            slices.append((node, cpus[start:start + size]))
    slices = slices[:instances] if instances is not None else slices
    rule = (f"{len(slices)} instance{'s' if len(slices) > 1 else ''} x {size} {kind}{where}, "
            "nodes filled in order, none spanning a node")
    return _layout(slices, by_node, use_logical_cores, rule)


def _layout(slices, by_node: dict[int, list[int]], logical: bool, rule: str) -> Layout:
    built = tuple(Instance(index=i, cpus=tuple(sorted(cpus)), node=node, omp_threads=len(cpus))
                  for i, (node, cpus) in enumerate(slices))
    used = {cpu for inst in built for cpu in inst.cpus}
    unused = tuple(sorted(cpu for cpus in by_node.values() for cpu in cpus if cpu not in used))
    return Layout(instances=built, use_logical_cores=logical, rule=rule, unused=unused)
