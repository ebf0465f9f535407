import os
import shutil
import sys
from pathlib import Path

import pytest

from torchkiln.runtime import bind, omp, preload
from torchkiln.runtime.launch import Host, build_plan
from torchkiln.runtime.layout import plan_layout
from torchkiln.runtime.torchrun import BIND_SCRIPT, TorchrunOptions

from .machines import XEON

PY = "/opt/py/bin/python3"
GNU = ("gnu", "libgomp.so.1 is loaded in this process")
INTEL = ("intel", "libiomp5.so is loaded in this process")
JEMALLOC = "/opt/lib/libjemalloc.so.2"
IOMP = "/opt/lib/libiomp5.so"


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "infer.py"
    path.write_text("print('hi')\n")
    return str(path)


def plan(script, omp_loaded=GNU, libraries=None, numactl=None, environ=None, layout=None, **kwargs):
    host = Host(python=PY, omp=omp_loaded, libraries=libraries or {}, numactl=numactl)
    layout = layout or plan_layout(XEON)
    return build_plan(layout, script, ["--batch", "8"], host, environ=environ or {}, **kwargs)


def test_gnu_openmp_environment(script):
    p = plan(script)
    assert p.omp == "gnu" and p.mode == "instances"
    a, b = p.processes
    assert a.env["OMP_NUM_THREADS"] == "24" and a.env["GOMP_CPU_AFFINITY"] == "0-23"
    assert b.env["GOMP_CPU_AFFINITY"] == "24-47" and b.env["OMP_PROC_BIND"] == "close"
    assert (a.env["TORCHKILN_INSTANCE"], b.env["TORCHKILN_INSTANCE"]) == ("0", "1")
    assert b.env["TORCHKILN_INSTANCES"] == "2"
    assert not any(k.startswith("KMP_") for k in a.env)


def test_intel_openmp_environment(script):
    p = plan(script, omp_loaded=INTEL)
    env = p.processes[0].env
    assert p.omp == "intel" and env["KMP_AFFINITY"] == "granularity=fine,compact,1,0"
    assert env["KMP_BLOCKTIME"] == "1"
    assert "GOMP_CPU_AFFINITY" not in env and "LD_PRELOAD" not in env


def test_omp_intel_preloads_libiomp5_over_libgomp(script):
    p = plan(script, libraries={"iomp": IOMP}, omp_choice="intel")
    assert p.omp == "intel" and p.processes[0].env["LD_PRELOAD"] == IOMP


def test_omp_intel_without_libiomp5_falls_back_to_gnu(script):
    p = plan(script, omp_choice="intel")
    assert p.omp == "gnu" and "GOMP_CPU_AFFINITY" in p.processes[0].env
    assert any("libiomp5.so not found" in n and "intel-openmp" in n for n in p.notes)


def test_allocator_found_is_preloaded_with_its_config(script):
    p = plan(script, libraries={"jemalloc": JEMALLOC, "tcmalloc": None})
    env = p.processes[1].env
    assert p.allocator == "jemalloc" and env["LD_PRELOAD"] == JEMALLOC
    assert "background_thread" in env["MALLOC_CONF"]


def test_auto_prefers_tcmalloc(script):
    p = plan(script, libraries={"jemalloc": JEMALLOC, "tcmalloc": "/opt/lib/libtcmalloc.so.4"})
    assert p.allocator == "tcmalloc" and "MALLOC_CONF" not in p.processes[0].env


@pytest.mark.parametrize("asked,note", [("auto", "no tcmalloc or jemalloc found"),
                                        ("tcmalloc", "libtcmalloc-minimal4"), ("jemalloc", "libjemalloc2")])
def test_allocator_missing_runs_without_it(script, asked, note):
    p = plan(script, memory_allocator=asked)
    assert p.allocator is None and "LD_PRELOAD" not in p.processes[0].env
    assert any(note in n for n in p.notes), p.notes


def test_default_allocator_preloads_nothing(script):
    p = plan(script, libraries={"jemalloc": JEMALLOC}, memory_allocator="default")
    assert p.allocator is None and "LD_PRELOAD" not in p.processes[0].env
    assert not any("malloc" in n for n in p.notes)


def test_user_environment_wins(script):
    environ = {"OMP_NUM_THREADS": "7", "LD_PRELOAD": "/x/libmine.so", "PYTHONUNBUFFERED": "0"}
    p = plan(script, libraries={"jemalloc": JEMALLOC}, environ=environ)
    env = p.processes[0].env
    assert "OMP_NUM_THREADS" not in env and "PYTHONUNBUFFERED" not in env
    assert env["LD_PRELOAD"] == f"{JEMALLOC}:/x/libmine.so"
    assert any("OMP_NUM_THREADS=7 is set in your environment and kept" in n for n in p.notes)


def test_numactl_present_binds_cpus_and_memory(script):
    p = plan(script, numactl="/usr/bin/numactl")
    a, b = p.processes
    assert b.command == ("/usr/bin/numactl", "--physcpubind=24-47", "--membind=1", PY, script, "--batch", "8")
    assert a.bind == "numactl" and a.env["PYTHONUNBUFFERED"] == "1"


def test_numactl_absent_binds_with_the_affinity_mask(script):
    p = plan(script)
    assert p.processes[0].command == (PY, script, "--batch", "8") and p.processes[0].bind == "affinity"


def test_missing_script_fails_before_anything(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        plan(str(tmp_path / "nope.py"))


def test_torchrun_command(script):
    opts = TorchrunOptions(nproc_per_node=2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500")
    p = plan(script, layout=plan_layout(XEON, instances=2), torchrun=opts, libraries={"jemalloc": JEMALLOC})
    (proc,) = p.processes
    assert p.mode == "torchrun" and proc.bind == "bind.py"
    assert proc.command == (PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=2",
                            "--node-rank=1", "--rdzv-endpoint=10.0.0.1:29500", BIND_SCRIPT,
                            "--slices=0-23@0/24-47@1", "--omp=gnu", "--", script, "--batch", "8")
    # torchrun would force OMP_NUM_THREADS=1 on every rank unless it is set.
    assert proc.env["OMP_NUM_THREADS"] == "24" and proc.env["LD_PRELOAD"] == JEMALLOC
    assert Path(BIND_SCRIPT).is_file()


def test_torchrun_command_with_numactl_and_logs(script):
    opts = TorchrunOptions(nproc_per_node=4, log_dir="/tmp/logs")
    p = plan(script, layout=plan_layout(XEON, instances=4), torchrun=opts, numactl="/usr/bin/numactl")
    cmd = p.processes[0].command
    assert "--log-dir=/tmp/logs" in cmd and "--tee=3" in cmd and "--numactl=/usr/bin/numactl" in cmd
    assert "--slices=0-11@0/12-23@0/24-35@1/36-47@1" in cmd and "--nnodes=1" not in cmd


def _elf_copy(path: Path) -> str:
    path.write_bytes(Path(sys.executable).read_bytes()[:64])  # this interpreter's ELF header: loadable here
    return str(path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF libraries")
def test_find_library_in_a_fake_search_path(tmp_path):
    env, system = tmp_path / "env", tmp_path / "sys"
    env.mkdir(), system.mkdir()
    jemalloc = _elf_copy(env / "libjemalloc.so.2")
    (env / "libtcmalloc.so.4").write_text("INPUT(-ltcmalloc)\n")  # a linker script, not a library
    assert preload.find_library("jemalloc", dirs=[str(env)], system=[str(system)], ldconfig="") == jemalloc
    assert preload.find_library("tcmalloc", dirs=[str(env)], system=[str(system)], ldconfig="") is None
    # Found through ldconfig's cache, after the environment's folders, before the system's.
    cached = _elf_copy(tmp_path / "libtcmalloc_minimal.so.4")
    ldconfig = (f"2 libs found in cache `/etc/ld.so.cache'\n"
                f"\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => {cached}\n")
    _elf_copy(system / "libtcmalloc.so.4")
    assert preload.find_library("tcmalloc", dirs=[], system=[str(system)], ldconfig=ldconfig) == cached
    assert preload.find_library("tcmalloc", dirs=[], system=[str(system)], ldconfig="") == str(
        system / "libtcmalloc.so.4")


def test_parse_ldconfig():
    text = ("3 libs found in cache `/etc/ld.so.cache'\n"
            "\tlibjemalloc.so.2 (libc6,x86-64) => /lib/x86_64-linux-gnu/libjemalloc.so.2\n"
            "\tlibgomp.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libgomp.so.1\n"
            "\tlibgomp.so.1 (libc6) => /lib32/libgomp.so.1\n")
    found = preload.parse_ldconfig(text)
    assert found["libjemalloc.so.2"] == ["/lib/x86_64-linux-gnu/libjemalloc.so.2"]
    assert len(found["libgomp.so.1"]) == 2


def test_omp_detection():
    assert omp.detect_omp("7f0 r-xp 0 08:01 1 /x/torch/lib/libgomp.so.1\n7f1 rw-p 0 00:00 0\n")[0] == "gnu"
    both = "a r-xp 0 0 1 /x/libgomp-a34b3233.so.1\nb r-xp 0 0 1 /y/libiomp5.so\n"
    assert omp.detect_omp(both) == ("intel", "libiomp5.so is loaded in this process")
    assert omp.classify("libomp.dylib") == "intel" and omp.classify("libompitrace.so") is None


def test_omp_detection_from_torchs_lib_folder(tmp_path):
    (tmp_path / "libomp.dylib").write_text("")
    assert omp.detect_omp("", torch_lib=tmp_path) == ("intel", "torch ships libomp.dylib")
    assert omp.detect_omp("", torch_lib=tmp_path / "absent")[0] == "gnu"


def test_omp_detection_here():
    # torch is imported in this process (pytest imported torchkiln), so its OpenMP is mapped.
    kind, evidence = omp.detect_omp()
    assert kind in ("gnu", "intel") and "loaded in this process" in evidence


def test_bind_cpu_syntax():
    assert bind.format_cpus([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert bind.parse_cpus("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    slices = [([0, 1, 2, 3], 0), ([24, 26], 1)]
    assert bind.parse_slices(bind.format_slices(slices)) == slices
    with pytest.raises(ValueError, match="omp='llvm'"):
        bind.omp_env("llvm", [0])


def test_numactl_probe_when_installed():
    from torchkiln.runtime.launch import _probe_numactl

    exe = shutil.which("numactl")
    if exe is None:
        pytest.skip("numactl not installed here")
    problem = _probe_numactl(exe, min(os.sched_getaffinity(0)), 0)
    assert problem is None or "failed here" in problem


def test_doctor_line_names_the_package_of_a_missing_allocator():
    from torchkiln import doctor

    line = doctor.allocator_line({"tcmalloc": None, "jemalloc": JEMALLOC})
    assert "tcmalloc: not found (Debian/Ubuntu: apt install libtcmalloc-minimal4" in line
    assert f"jemalloc: {JEMALLOC}" in line
    assert set(doctor.allocators()) == {"tcmalloc", "jemalloc"}
