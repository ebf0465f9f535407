import json

import pytest

from torchkiln.hardware import detect_topology
from torchkiln.runtime.layout import plan_layout

from .machines import ARM, EPYC, XEON

THIS = detect_topology()
MACHINES = {"xeon-2s-ht": XEON, "epyc-nps4": EPYC, "neoverse-72": ARM, "this-machine": THIS}
REQUESTS = [
    {},
    {"instances": 1},
    {"instances": 2},
    {"instances": 3},
    {"instances": 8},
    {"cores_per_instance": 1},
    {"cores_per_instance": 4},
    {"cores_per_instance": 16},
    {"instances": 2, "cores_per_instance": 2},
    {"node_id": 0},
    {"node_id": 0, "instances": 2},
    {"use_logical_cores": True},
    {"use_logical_cores": True, "instances": 4},
    {"use_logical_cores": True, "cores_per_instance": 2},
]


def check(topo, layout, logical=False):
    node_of = {c.cpu: c.node for c in topo.cpus}
    physical = {c.cpu for c in topo.physical()}
    handed = [cpu for inst in layout.instances for cpu in inst.cpus]
    assert len(handed) == len(set(handed)), "a CPU went to two instances"
    assert not set(handed) & set(layout.unused)
    for i, inst in enumerate(layout.instances):
        assert inst.index == i and inst.omp_threads == len(inst.cpus) > 0
        assert {node_of[c] for c in inst.cpus} == {inst.node}, "an instance spans NUMA nodes"
        assert list(inst.cpus) == sorted(inst.cpus)
        if not logical:
            assert set(inst.cpus) <= physical, "a hyperthread sibling was used by default"
    json.loads(json.dumps(layout.to_dict()))


def _id(request_):
    return ",".join(f"{k}={v}" for k, v in request_.items()) or "default"


@pytest.mark.parametrize("request_", REQUESTS, ids=_id)
@pytest.mark.parametrize("name", list(MACHINES))
def test_invariants(name, request_):
    topo = MACHINES[name]
    try:
        layout = plan_layout(topo, **request_)
    except ValueError as e:
        # Only a request the machine cannot hold may fail, and the message names the argument.
        assert name == "this-machine", e
        assert any(f"{k}=" in str(e) for k in request_), e
        return
    check(topo, layout, request_.get("use_logical_cores", False))
    if "instances" in request_:
        assert len(layout.instances) == request_["instances"]
    if "instances" in request_ or "cores_per_instance" in request_:
        assert len({i.omp_threads for i in layout.instances}) == 1, "instances of unequal size"
    # With neither, every allowed CPU of the counted kind is handed out exactly once.
    if not {"instances", "cores_per_instance", "node_id"} & set(request_):
        pool = topo.cpus if request_.get("use_logical_cores") else topo.physical()
        assert sorted(c for i in layout.instances for c in i.cpus) == [c.cpu for c in pool]


def slices(layout):
    return [(i.node, i.cpus[0], i.cpus[-1], len(i.cpus)) for i in layout.instances]


def test_xeon_default_is_one_instance_per_node():
    layout = plan_layout(XEON)
    assert slices(layout) == [(0, 0, 23, 24), (1, 24, 47, 24)]
    assert "per NUMA node" in layout.rule and layout.unused == ()


def test_xeon_logical_cores_take_both_threads():
    layout = plan_layout(XEON, use_logical_cores=True)
    assert layout.instances[0].cpus == tuple(range(24)) + tuple(range(48, 72))
    # An even slice never splits a core between two instances: cpu 0 and its sibling 48 stay together.
    (a, b, *_) = plan_layout(XEON, use_logical_cores=True, cores_per_instance=2).instances
    assert (a.cpus, b.cpus) == ((0, 48), (1, 49))


def test_xeon_three_instances_fill_nodes_in_order():
    layout = plan_layout(XEON, instances=3)
    assert slices(layout) == [(0, 0, 11, 12), (0, 12, 23, 12), (1, 24, 35, 12)]
    assert layout.unused == tuple(range(36, 48))


def test_xeon_cores_per_instance_fits_per_node():
    layout = plan_layout(XEON, cores_per_instance=5)
    assert len(layout.instances) == 8  # 4 per node; 4 cores of each node stay free
    assert layout.unused == (20, 21, 22, 23, 44, 45, 46, 47)


def test_xeon_node_id():
    layout = plan_layout(XEON, node_id=1)
    assert slices(layout) == [(1, 24, 47, 24)]


def test_epyc_default_is_four_nodes():
    assert slices(plan_layout(EPYC)) == [(n, 16 * n, 16 * n + 15, 16) for n in range(4)]
    assert slices(plan_layout(EPYC, instances=8))[:2] == [(0, 0, 7, 8), (0, 8, 15, 8)]


def test_arm_single_node():
    assert slices(plan_layout(ARM)) == [(0, 0, 71, 72)]
    assert slices(plan_layout(ARM, instances=4)) == [(0, 18 * k, 18 * k + 17, 18) for k in range(4)]
    assert plan_layout(ARM, use_logical_cores=True).instances == plan_layout(ARM).instances


def test_this_machine_default_uses_every_allowed_core():
    layout = plan_layout(THIS)
    check(THIS, layout)
    assert sum(len(i.cpus) for i in layout.instances) == len(THIS.physical())


@pytest.mark.parametrize("kwargs,words", [
    ({"instances": 49}, ["instances=49", "48 physical cores", "at most 48", "use_logical_cores"]),
    ({"cores_per_instance": 25}, ["cores_per_instance=25", "24 physical cores on node 0", "at most 24"]),
    ({"node_id": 2}, ["node_id=2", "use one of: 0, 1"]),
    ({"instances": 3, "cores_per_instance": 24}, ["instances=3 x cores_per_instance=24", "only 2",
                                                  "cores_per_instance to 12"]),
    ({"instances": 0}, ["instances=0", "positive integer"]),
    ({"cores_per_instance": -1}, ["cores_per_instance=-1", "positive integer"]),
    ({"node_id": 1, "instances": 25}, ["instances=25", "on node 1", "at most 24"]),
])
def test_bad_input_names_argument_value_and_fix(kwargs, words):
    with pytest.raises(ValueError) as e:
        plan_layout(XEON, **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
