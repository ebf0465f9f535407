"""Host memory checks (torchkiln/hostmem.py): what is available, read from fake /proc and cgroup files,
and optimize() skipping the candidates that would not fit rather than meeting the OOM killer."""

import sys
import warnings

import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln import _log, hostmem


def fake(tmp_path, meminfo_kb=None, v2=None, v1=None):
    (tmp_path / "cg" / "memory").mkdir(parents=True)
    if meminfo_kb is not None:
        (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {meminfo_kb} kB\n")
    if v2 is not None:
        (tmp_path / "cg" / "memory.max").write_text(f"{v2[0]}\n")
        (tmp_path / "cg" / "memory.current").write_text(f"{v2[1]}\n")
    if v1 is not None:
        (tmp_path / "cg" / "memory" / "memory.limit_in_bytes").write_text(f"{v1[0]}\n")
        (tmp_path / "cg" / "memory" / "memory.usage_in_bytes").write_text(f"{v1[1]}\n")
    return hostmem.available_bytes(str(tmp_path / "meminfo"), str(tmp_path / "cg"))


GiB = 1 << 30


@pytest.mark.parametrize("v2,v1,want", [
    (None, None, 8 * GiB),                       # no cgroup files: the kernel's MemAvailable
    (("max", GiB), None, 8 * GiB),               # v2 without a limit
    ((4 * GiB, GiB), None, 3 * GiB),             # a container's limit below what the host has free
    ((20 * GiB, GiB), None, 8 * GiB),            # a limit above it
    (None, (1 << 62, GiB), 8 * GiB),             # v1's "no limit" is a huge number
    (None, (2 * GiB, GiB // 2), GiB + GiB // 2),  # v1 with a limit
    ((GiB, 2 * GiB), None, 0),                   # over the limit already: nothing, not negative
], ids=["meminfo", "v2-max", "v2-limit", "v2-above", "v1-none", "v1-limit", "v2-over"])
def test_available_memory_is_the_least_of_the_host_and_the_cgroup(tmp_path, v2, v1, want):
    assert fake(tmp_path, 8 * GiB // 1024, v2, v1) == want


def test_unknown_memory_never_skips(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # no /proc/meminfo and no psutil: unknown
    assert fake(tmp_path) is None and hostmem.fits(1 << 50, None) and not hostmem.fits(10, 10)


def test_build_estimate_counts_weights_in_the_candidates_dtype():
    m = nn.Sequential(nn.Linear(10, 10), nn.Embedding(4, 5))  # 110 + 20 floating values
    m.register_buffer("ids", torch.zeros(3, dtype=torch.int64))
    assert hostmem.build_bytes(m, torch.bfloat16, compiled=False) == 130 * 2 + 3 * 8
    assert hostmem.build_bytes(m, torch.float32, compiled=True) == (130 * 4 + 3 * 8) * 2


def test_candidates_that_would_not_fit_are_skipped_and_the_model_as_given_serves(monkeypatch):
    """With no room for a copy, every candidate that makes one is skipped (said once, reasons in the
    report) and a candidate that runs the original's own tensors serves, with eager's numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    x = torch.randn(4, 32)
    free = sum(p.numel() for p in model.parameters()) * 2  # less than one bf16 copy, twice
    monkeypatch.setattr(hostmem, "available_bytes", lambda *a, **k: free)
    _log._warned.clear()
    with pytest.warns(UserWarning, match="not enough host memory to build every candidate"):
        fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=x)
    by = {m.name: m for m in fast.kiln_report.candidates}
    skipped = [m for m in by.values() if m.status == "skipped"]
    assert skipped and all("GiB of host memory available" in m.reason for m in skipped)
    assert any(m.kind == "torchkiln" for m in skipped) and any(m.kind == "stock" for m in skipped)
    served = by[fast.kiln_report.active]
    assert fast._served.live_weights, served
    with torch.no_grad():
        want = model(x)
        got = fast(x)
    tol = 1e-5 if fast.kiln_report.dtype_served == "float32" else 5e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_with_room_nothing_is_skipped(monkeypatch):
    monkeypatch.setattr(hostmem, "available_bytes", lambda *a, **k: 1 << 40)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=torch.randn(4, 32))
    assert not [m for m in fast.kiln_report.candidates if m.status == "skipped"]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(hostmem._malloc_trim() is None or not sys.platform.startswith("linux"),
                    reason="glibc's malloc_trim (Linux)")
def test_give_back_returns_freed_heap_to_the_os():
    """The case optimize() leaves: chunks freed below glibc's mmap threshold (raised by a 16 MB free)
    stay in the process until trimmed."""
    big = torch.ones(4 << 20)
    del big
    chunks = [torch.ones(1 << 18) for _ in range(300)]  # 300 x 1 MB, from the heap now
    pin = torch.ones(1 << 18)  # noqa: F841 - a live chunk above them, as the served model's are
    del chunks
    before = rss_mb()
    hostmem.give_back()
    assert before - rss_mb() > 200


def test_optimize_gives_back_after_choosing(monkeypatch):
    calls = []
    monkeypatch.setattr(hostmem, "give_back", lambda: calls.append(1))
    monkeypatch.setattr(hostmem, "LARGE", 0)  # an 8x8 model counts as large here
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    fast = tk.optimize(model, sample_input=torch.randn(2, 8), time_budget=0.1)
    assert calls == [1]
    fast(torch.randn(2, 8))
    assert calls == [1]  # once per selection, not per call


def test_small_models_skip_the_collection(monkeypatch):
    calls = []
    monkeypatch.setattr(hostmem, "give_back", lambda: calls.append(1))
    tk.optimize(nn.Sequential(nn.Linear(8, 8)).eval(), sample_input=torch.randn(2, 8), time_budget=0.1)
    assert calls == [] and not hostmem.worth_returning(nn.Linear(8, 8))


def test_with_room_for_two_copies_every_candidate_is_still_built_and_the_fastest_serves(monkeypatch):
    """Memory for about two copies at a time (a fake MemAvailable that shrinks by each live build):
    before a build that would not fit, the ones built so far are timed, the fastest kept and the
    rest freed, so every candidate is built and competes; none is skipped, and what serves is the
    fastest measured. Before, those that did not fit beside the first ones were skipped."""
    import weakref

    from torchkiln.optimize import KilnModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    x = torch.randn(8, 64)
    need = hostmem.build_bytes(model, torch.float32, compiled=True)
    live = []
    real_try = KilnModule._try

    def tracking(self, cand, *a):
        fn, out, why = real_try(self, cand, *a)
        if fn is not None and not cand.live_weights:
            live.append(weakref.ref(fn))
        return fn, out, why

    monkeypatch.setattr(KilnModule, "_try", tracking)
    budget = int(need / hostmem.MARGIN) + need  # room for one more beside one live copy, not beside two
    monkeypatch.setattr(hostmem, "available_bytes",
                        lambda *a, **k: max(0, budget - need * sum(r() is not None for r in live)))
    _log._warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=x)
    by = {m.name: m for m in fast.kiln_report.candidates}
    assert not [m for m in by.values() if m.status == "skipped"], by
    assert not [m for m in w if "not enough host memory" in str(m.message)]  # nothing was skipped
    freed = [m for m in by.values() if "freed to make room" in (m.reason or "")]
    assert freed and all(m.median_ms is not None for m in freed)
    final = {m.name: m.median_ms for m in by.values() if m.status in ("passed", "served") and m not in freed
             and m.median_ms is not None}  # the last round (the freed ones lost an earlier one)
    assert fast.kiln_report.active == min(final, key=final.get)
    with torch.no_grad():
        torch.testing.assert_close(fast(x).float(), model(x), rtol=5e-2, atol=5e-2)
