"""Does the per-signature timing read the right answer? Its in-call verdicts against a steady stream.

``KilnModule._slower_than_given`` times the served form against the model as given at each of the
first new input signatures, inside that signature's first call, and detours to the model as given
when the median is slower by more than ``SHAPE_MARGIN``. For an MLP (6 x Linear 512 + LayerNorm +
GELU) optimized at 64 rows with ``graph_mode=False, candidates="torchkiln"`` (the eager passes
serve), this repeats that in-call timing ``--repeats`` times per (dtype, rows) case, then times the
returned model against the model as given in a steady stream (interleaved blocks of 20 calls), and
prints the served/given ratios: the in-call medians and minimums next to the steady-stream truth.
``--fresh N`` reads as real use does instead: N fresh ``tk.optimize`` calls per case, each called
1 + ``SHAPE_RECHECK`` times at the new signature (its first reading, and a close one's second), then the
steady stream of the last one's served form (raw) and of the last returned model against the model as given.

    python benchmarks/diag_shape_rule.py [--cases float32:1 bfloat16:1 bfloat16:8 float32:8] [--repeats 8]
    python benchmarks/diag_shape_rule.py --fresh 8
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import warnings

import torch
from shape_timing import mlp, steady, streams

import torchkiln as tk

_opt = importlib.import_module("torchkiln.optimize")  # the module: torchkiln.optimize is also the function


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["float32:1", "bfloat16:1", "bfloat16:8", "float32:8"])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--fresh", type=int, default=0, help="first readings of N fresh optimize() calls per case")
    a = ap.parse_args()
    if a.fresh:
        return fresh(a)
    warnings.simplefilter("ignore")
    seen: list[dict] = []
    real = _opt.blocks

    def spy(calls, device, budget, rounds=5):  # what the in-call timing measured, kept for the table
        out = real(calls, device, budget, rounds)
        seen.append({k: (statistics.median(v), min(v)) for k, v in out.items()})
        return out

    _opt.blocks = spy
    model = mlp()
    print(f"margin {_opt.SHAPE_MARGIN}: served/given above it detours\n")
    print("| dtype | rows | steady median | steady min | in-call medians | detoured | in-call minimums |")
    print("|---|---|---|---|---|---|---|")
    for case in a.cases:
        name, rows = case.split(":")
        fast = tk.optimize(model, dtype=getattr(torch, name), sample_input=torch.randn(64, 512),
                           graph_mode=False, candidates="torchkiln")
        x = torch.randn(int(rows), 512)
        with torch.no_grad():
            fast(torch.randn(64, 512))  # the selection, at the sample's shape
            seen.clear()
            for _ in range(a.repeats):
                fast._slower_than_given((x,), {})  # private: the in-call timing alone, repeated
            med = [s["served"][0] / s["given"][0] for s in seen]
            low = [s["served"][1] / s["given"][1] for s in seen]
            ms = streams({"served": fast, "given": model}, x, a.rounds, 20)
        truth = statistics.median(ms["served"]) / statistics.median(ms["given"])
        truth_min = min(ms["served"]) / min(ms["given"])
        detoured = sum(r > _opt.SHAPE_MARGIN for r in med)
        print(f"| {name} | {rows} | {truth:.2f} | {truth_min:.2f} | {' '.join(f'{r:.2f}' for r in med)} "
              f"| {detoured}/{len(med)} | {' '.join(f'{r:.2f}' for r in low)} |", flush=True)


def fresh(a) -> None:
    warnings.simplefilter("ignore")
    model = mlp()
    n = 1 + _opt.SHAPE_RECHECK  # the first reading's call, then the calls up to a close one's second reading
    print(f"margin {_opt.SHAPE_MARGIN}: a reading above it detours; a first reading that keeps the served form "
          f"and is within {_opt.SHAPE_CLOSE} of the model as given is read again {_opt.SHAPE_RECHECK} calls later\n")
    print("| dtype | rows | first readings (served / given) | detoured at first | second readings | detoured "
          f"after {n} calls | steady, served form raw | steady, the last returned model |")
    print("|---|---|---|---|---|---|---|---|")
    for case in a.cases:
        name, rows = case.split(":")
        x = torch.randn(int(rows), 512)
        first, second, detoured = [], [], 0
        with torch.no_grad():
            for _ in range(a.fresh):
                fast = tk.optimize(model, dtype=getattr(torch, name), sample_input=torch.randn(64, 512),
                                   graph_mode=False, candidates="torchkiln")
                for _ in range(n):
                    fast(x)
                reads = [s["served_ms"] / s["given_ms"] for s in tk.report(fast).shapes]
                first.append(reads[0])
                second += reads[1:]
                detoured += tk.report(fast).shapes[-1]["serves"] == "original model"
            t = steady({"given": model, "raw": fast._fn, "returned": fast}, x, max(3, a.rounds // 4))
        fmt = lambda rs: " ".join(f"{r:.2f}" for r in rs) or "-"  # noqa: E731
        print(f"| {name} | {rows} | {fmt(first)} | {sum(r > _opt.SHAPE_MARGIN for r in first)}/{len(first)} | "
              f"{fmt(second)} | {detoured}/{len(first)} | {t['raw'] / t['given']:.2f} | "
              f"{t['returned'] / t['given']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
