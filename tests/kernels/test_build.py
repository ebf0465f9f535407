"""torchkiln/kernels/build.py: the cached compile of torchkiln's C++ sources, and what a failed
build leaves (a reason, no file; callers keep torch's kernels or the Python form)."""

from __future__ import annotations

import subprocess

import pytest

from torchkiln.kernels import build, cpu_gemv, weight_watch

has_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")


def _broken(cxx, source, out, flags, libs, python=False):
    return [cxx, "-x", "c++", "-c", "/dev/null", "-DX=(", "-o", str(out), "--no-such-flag"]


@has_compiler
def test_a_failed_build_is_a_reason_and_leaves_no_file(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "command", _broken)
    if cpu_gemv._why_not_here() is None:
        assert cpu_gemv.load.__wrapped__().startswith("build failed: compiling cpu_gemv.cpp failed")
    module, why = weight_watch.load.__wrapped__()
    assert module is None and why.startswith("build failed: compiling weight_watch.cpp failed")
    assert not any((tmp_path / "torchkiln" / "kernels").iterdir())  # no half-written library left


def test_no_compiler_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    module, why = weight_watch.load.__wrapped__()
    assert module is None and "no C++ compiler found (no-such-compiler-here is not on PATH)" in why


@has_compiler
def test_the_build_is_cached_by_source_torch_and_flags(monkeypatch, tmp_path):
    """One compile per source, torch, flags and compiler; the second call finds the file. (A one-line
    source: the real ones include torch's headers, ~20 s a compile, 67 s of the default suite here.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs = []
    real = subprocess.run
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: runs.append(a) or real(*a, **k))
    source = tmp_path / "one.cpp"
    source.write_text('extern "C" int torchkiln_test_one() { return 1; }\n')
    first = build.build(source, [], [])
    assert first.parent == tmp_path / "torchkiln" / "kernels" and first.stat().st_size > 0
    assert build.build(source, [], []) == first and len(runs) == 1
    assert build.build(source, ["-DTORCHKILN_TEST_FLAG=1"], []) != first and len(runs) == 2
    source.write_text('extern "C" int torchkiln_test_one() { return 2; }\n')
    assert build.build(source, [], []) != first and len(runs) == 3
    source.write_text('extern "C" int torchkiln_test_one() { return 1; }\n')
    monkeypatch.setattr(build.torch, "__version__", "0.0.0-other")
    assert build.build(source, [], []) != first and len(runs) == 4


def test_missing_python_headers_are_a_reason_before_any_compile(monkeypatch, tmp_path):
    import sysconfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "include": str(tmp_path / "none")})
    monkeypatch.setattr(build, "build", lambda *a, **k: pytest.fail("compiled without Python's headers"))
    module, why = weight_watch.load.__wrapped__()
    assert module is None and "Python's headers are not installed" in why and "python3-dev" in why
