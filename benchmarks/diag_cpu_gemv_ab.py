"""torchkiln's CPU GEMV (kernels/cpu_gemv.cpp) against the same kernel at another git revision,
one process, interleaved rounds (medians), on llama-350m's decode shapes:

    python benchmarks/diag_cpu_gemv_ab.py --rev HEAD~1

The other revision's source is built under its own op namespace (``kiln_ab::cpu_gemv``), so both
load side by side. Each peer cycles through copies of its weights (>= 160 MB in all), so they come
from DRAM, not the L3 cache; GB/s counts the weight bytes read once per call, against the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from llm_gemv_cpu import one

from torchkiln.kernels import cpu_gemv
from torchkiln.llm import bench

SHAPES = {"qkv": (3072, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}


def build_other(rev: str, out: Path) -> None:
    src = subprocess.run(["git", "show", f"{rev}:torchkiln/kernels/cpu_gemv.cpp"], capture_output=True, text=True,
                         check=True).stdout
    src = src.replace("TORCH_LIBRARY_FRAGMENT(torchkiln,", "TORCH_LIBRARY_FRAGMENT(kiln_ab,")
    src = src.replace("TORCH_LIBRARY_IMPL(torchkiln,", "TORCH_LIBRARY_IMPL(kiln_ab,")
    path = out.with_suffix(".cpp")
    path.write_text(src)
    cmd = cpu_gemv._command(cpu_gemv._compiler(), out)
    cmd[cmd.index(str(cpu_gemv.SOURCE))] = str(path)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"building {rev}'s kernel failed: {done.stderr[-800:]}")
    torch.ops.load_library(str(out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD~1", help="the git revision to compare against")
    ap.add_argument("--weights", default="int8,bfloat16,float32")
    ap.add_argument("--x", default="bfloat16,float32", help="x dtypes")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    why = cpu_gemv.load()
    if why:
        raise SystemExit(f"torchkiln's kernel is not built here: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        build_other(a.rev, Path(tmp) / "ab.so")
    bw = bench.copy_bandwidth(torch.device("cpu"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; copy bandwidth {bw / 1e9:.1f} GB/s; "
          f"{a.rev} against the working tree, {a.rounds} interleaved rounds, medians\n")
    print(f"| weights | x | rows | shape | {a.rev} GB/s | this GB/s | this / {a.rev} |\n|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for wname in a.weights.split(","):
        wd = getattr(torch, wname)
        for xname in a.x.split(","):
            xd = getattr(torch, xname)
            for rows in [int(r) for r in a.rows.split(",")]:
                for name, (n, k) in SHAPES.items():
                    size = n * k * wd.itemsize
                    copies = max(2, (160 << 20) // size)
                    ws = [torch.randint(-127, 128, (n, k), dtype=torch.int8).to(wd) for _ in range(copies)]
                    s = (torch.rand(n) / 100).to(xd) if wd == torch.int8 else None
                    x = torch.randn(rows, k).to(xd)
                    forms = {"other": torch.ops.kiln_ab.cpu_gemv, "this": torch.ops.torchkiln.cpu_gemv}
                    args = [(x, w, s) for w in ws]
                    times = {f: [] for f in forms}
                    for _ in range(a.rounds):
                        for f, op in forms.items():
                            times[f].append(one(op, args, max(48, 2 * copies)))
                    old, new = (size / statistics.median(times[f]) / 1e9 for f in forms)
                    print(f"| {wname} | {xname} | {rows} | {name} {n}x{k} | {old:.1f} | {new:.1f} | {new / old:.2f}x |",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
