"""torchkiln against IPEX 2.8 (and stock torch.compile) on the CPU, over a grid of cells.

    bash benchmarks/ipex_env.sh                      # once: the separate IPEX venv (~7 GB)
    python benchmarks/vs_ipex.py --models resnet50,bert-base --dtypes float32,int8 --batches 1,8

One cell is `torchkiln bench MODEL --peer ipex` (torchkiln/ipex_peer.py): each peer is its own
served process, built one after another (no overlap), then timed interleaved: --rounds rounds,
each asking every peer for --iters calls in turn (the order rotates per round). The table gives
the median of per-round medians, and torchkiln / IPEX as the median of the per-round paired
ratios (>1: torchkiln faster).
"""

import argparse
import sys
from datetime import date

from torchkiln import ipex_peer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ipex-python", default=None, help="the IPEX venv's python (default: "
                                                         "$TORCHKILN_IPEX_PYTHON, else ~/.cache/torchkiln/ipex-venv)")
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--iters", type=int, default=8, help="calls per peer per round")
    ap.add_argument("--peers", default="compile,ipex,torchkiln", help="which of compile,ipex,torchkiln to run")
    ap.add_argument("--results", help="append the table to this markdown file")
    a = ap.parse_args()
    rows = []
    for model in a.models.split(","):
        for batch in [int(b) for b in a.batches.split(",")]:
            for dtype in a.dtypes.split(","):
                cell = ipex_peer.compare(model, dtype, batch, tuple(a.peers.split(",")), a.rounds, a.iters,
                                         a.ipex_python)
                print(cell.row(), flush=True)
                if cell.candidates_ms:  # what optimize() timed when it chose what it served
                    print("  optimize() measured: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in cell.candidates_ms.items()))
                if cell.applied:
                    print("  applied: " + "; ".join(cell.applied))
                rows.append(cell.row())
    text = "\n".join([ipex_peer.HEADER, *rows])
    print("\n" + text)
    if a.results:
        with open(a.results, "a") as f:
            f.write(f"\n### {date.today()} `python benchmarks/vs_ipex.py {' '.join(sys.argv[1:])}`\n\n{text}\n")


if __name__ == "__main__":
    main()
