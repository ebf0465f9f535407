"""runtime/allocator.py: glibc keeps freed memory, so a block allocated again is not faulted in again."""

import json
import subprocess
import sys

import pytest

from torchkiln.runtime import allocator

# A child process: this test process must keep glibc's defaults for the first half of the measurement.
CHILD = r"""
import json, resource, torch
from torchkiln.runtime import allocator

def faults_per_round(rounds=16, mib=64):
    out = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.ones(mib << 18)  # mib MiB of float32, every page written
        del t
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out

default = faults_per_round()
said = allocator.keep_freed_memory()
kept = faults_per_round()
print(json.dumps({"default": default, "kept": kept, "said": said, "again": allocator.keep_freed_memory()}))
"""


@pytest.mark.skipif(allocator.why_not() is not None, reason="needs glibc's malloc (Linux with glibc)")
def test_a_freed_large_block_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    pages = (64 << 20) // 4096
    # glibc's default: a 64 MiB block is mmapped and unmapped each time, so every round faults it in again
    assert min(r["default"][1:]) > pages // 2, r
    # kept: the heap grows for the first rounds (small allocations split the freed block, so a few
    # rounds take fresh pages: 8 with 2 threads here), then the block is reused without faults
    assert sum(r["kept"][-4:]) < pages // 4, r
    assert "M_MMAP_MAX=0" in r["said"] and r["again"] == r["said"]  # applied once, then reported as is


def test_another_allocator_is_left_alone(monkeypatch):
    monkeypatch.setattr(allocator, "_maps", lambda: "7f00 r-xp 00000000 /usr/lib/libjemalloc.so.2\n")
    monkeypatch.setattr(allocator, "_DONE", None)
    if allocator.why_not() is not None and "jemalloc" not in allocator.why_not():
        pytest.skip("not glibc: the jemalloc check is not reached")
    assert "jemalloc is loaded" in allocator.why_not()
    with pytest.raises(OSError, match="jemalloc is loaded"):
        allocator.keep_freed_memory()
