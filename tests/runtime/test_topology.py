import os
import shutil

import pytest

from torchkiln.hardware import Topology, detect_topology
from torchkiln.hardware.topology import parse_cpu_list, parse_lscpu_p, read_sysfs

from .machines import NO_NUMA_HT, THIS_DEV_BOX, XEON, xeon_2s_ht


def test_captured_lscpu_text():
    topo = parse_lscpu_p(THIS_DEV_BOX)
    assert [(c.cpu, c.core, c.socket, c.node, c.first_thread) for c in topo.cpus] == [
        (0, 0, 0, 0, True), (1, 1, 0, 0, True)]
    assert topo.source == "lscpu" and topo.nodes() == (0,)


def test_siblings_and_an_empty_node_column():
    topo = parse_lscpu_p(NO_NUMA_HT)
    assert topo.nodes() == (0,)
    assert [c.cpu for c in topo.physical()] == [0, 1]  # 2 and 3 are the second threads


def test_two_socket_xeon():
    assert len(XEON.cpus) == 96 and len(XEON.physical()) == 48 and XEON.nodes() == (0, 1)
    cpu48 = XEON.cpus[48]
    assert (cpu48.core, cpu48.socket, cpu48.node, cpu48.first_thread) == (0, 0, 0, False)


def test_affinity_mask_is_respected():
    # Only the second threads are allowed: each is now the first allowed thread of its core.
    topo = parse_lscpu_p(xeon_2s_ht(), allowed=set(range(48, 96)))
    assert [c.cpu for c in topo.cpus] == list(range(48, 96))
    assert all(c.first_thread for c in topo.cpus)


def test_cpu_list_syntax():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("") == []


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_sysfs_fallback(tmp_path):
    # 2 packages x 2 cores x 2 threads; core_id restarts in each package (as sysfs numbers them),
    # cpu 7 is offline, one package id is -1 (some Arm firmware).
    layout = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1), 4: (0, 0), 5: (1, 0), 6: (0, 1), 7: (1, 1)}
    for cpu, (core, package) in layout.items():
        _write(tmp_path / f"cpu/cpu{cpu}/topology/core_id", f"{core}\n")
        _write(tmp_path / f"cpu/cpu{cpu}/topology/physical_package_id", f"{-1 if cpu == 0 else package}\n")
    _write(tmp_path / "cpu/online", "0-6\n")
    (tmp_path / "cpu/cpufreq").mkdir()  # not a cpuN folder
    _write(tmp_path / "node/node0/cpulist", "0-1,4-5\n")
    _write(tmp_path / "node/node1/cpulist", "2-3,6-7\n")
    topo = read_sysfs(tmp_path)
    assert topo.source == "sysfs" and [c.cpu for c in topo.cpus] == list(range(7))
    assert [(c.cpu, c.node) for c in topo.physical()] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert read_sysfs(tmp_path, allowed={4, 5}).physical() == read_sysfs(tmp_path, allowed={4, 5}).cpus
    # The same machine seen through lscpu gives the same facts.
    text = "\n".join(f"{c.cpu},{c.socket * 2 + c.core},{c.socket},{c.node}" for c in topo.cpus)
    assert [(c.cpu, c.node, c.first_thread) for c in parse_lscpu_p(text).cpus] == [
        (c.cpu, c.node, c.first_thread) for c in topo.cpus]


def test_sysfs_missing_gives_nothing(tmp_path):
    assert read_sysfs(tmp_path).cpus == ()


def test_this_machine():
    topo = detect_topology()
    assert isinstance(topo, Topology) and topo.physical()
    assert {c.cpu for c in topo.cpus} == os.sched_getaffinity(0)
    if shutil.which("lscpu"):
        assert topo.source == "lscpu"
    via_sysfs = read_sysfs(allowed=os.sched_getaffinity(0))
    if via_sysfs.cpus:
        assert [c.cpu for c in via_sysfs.physical()] == [c.cpu for c in topo.physical()]
        assert [c.node for c in via_sysfs.cpus] == [c.node for c in topo.cpus]


def test_a_narrower_mask_is_honoured():
    one = min(os.sched_getaffinity(0))
    topo = detect_topology(allowed={one})
    assert [c.cpu for c in topo.cpus] == [one] and topo.cpus[0].first_thread


@pytest.mark.parametrize("text", ["", "garbage\n# only a comment\n1,2\n"])
def test_garbled_lscpu_text_gives_nothing(text):
    assert parse_lscpu_p(text).cpus == ()
