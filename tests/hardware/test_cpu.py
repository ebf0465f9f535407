from pathlib import Path

import pytest

from torchkiln.hardware.cpu import build_cpu_info, parse_cpuinfo

DATA = Path(__file__).parent / "data"


def load(name):
    return (DATA / name).read_text()


def test_intel_amx_server():
    info = build_cpu_info(load("cpuinfo_intel_spr.txt"), load("lscpu_intel_spr.txt"), load("meminfo_512g.txt"))
    assert info.vendor == "GenuineIntel" and info.is_intel and not info.is_amd
    assert info.model == "Intel(R) Xeon(R) Platinum 8480+"
    # lscpu's topology wins over the (truncated) cpuinfo sample: 2 sockets x 56 cores.
    assert (info.sockets, info.physical_cores, info.numa_nodes) == (2, 112, 2)
    assert info.memory_bytes == 527951244 * 1024
    for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
              "amx_tile", "amx_bf16", "amx_int8"):
        assert info.has(f), f
    assert info.bf16_native and info.fp16_native and info.int8_dot
    assert info.unknown == {}


def test_amd_zen_server():
    info = build_cpu_info(load("cpuinfo_amd_genoa.txt"), load("lscpu_amd_genoa.txt"), load("meminfo_512g.txt"))
    assert info.is_amd and info.model.startswith("AMD EPYC 9654")
    assert (info.sockets, info.physical_cores, info.numa_nodes) == (1, 96, 4)
    assert info.has("avx512f", "avx512_bf16", "avx512_vnni")
    assert not info.has("amx_tile") and not info.has("avx512_fp16") and not info.has("avx_vnni")
    assert info.bf16_native and not info.fp16_native


def test_arm_server():
    info = build_cpu_info(load("cpuinfo_arm_grace.txt"), load("lscpu_arm_grace.txt"), None)
    assert info.arch == "aarch64" and info.vendor == "ARM" and info.model == "Neoverse-V2"
    assert info.physical_cores == 72 and info.sockets == 1
    assert info.has("neon", "sve", "sve2", "bf16", "i8mm")
    assert not info.has("avx2")
    assert info.bf16_native and info.int8_dot
    # meminfo missing: None with a reason, not a crash
    assert info.memory_bytes is None and "memory_bytes" in info.unknown


def test_cpuinfo_alone_counts_cores_and_sockets():
    # Without lscpu: 2 sockets x 4 cores x 2 threads in the fixture.
    d = parse_cpuinfo(load("cpuinfo_intel_spr.txt"))
    assert (d["logical_cores"], d["physical_cores"], d["sockets"]) == (16, 8, 2)
    d = parse_cpuinfo(load("cpuinfo_arm_grace.txt"))
    assert d["vendor"] == "ARM" and d["logical_cores"] == 4 and d["physical_cores"] is None


@pytest.mark.parametrize("cpuinfo,lscpu", [(None, None), ("", ""), ("garbage\n\n:::", "no colon here")])
def test_missing_or_garbled_sources_degrade(cpuinfo, lscpu):
    info = build_cpu_info(cpuinfo, lscpu, None)
    assert info.vendor is None and info.physical_cores is None
    assert {"vendor", "physical_cores", "memory_bytes"} <= set(info.unknown)


def test_this_machine_detects_without_error():
    from torchkiln.hardware.cpu import detect_cpu

    info = detect_cpu()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    # Cross-check against the raw flag list, read independently here.
    assert info.has("avx512_bf16") == (" avx512_bf16" in flags)
    assert info.has("avx512f") == (" avx512f" in flags)
