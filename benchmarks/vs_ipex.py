"""torchkiln against IPEX 2.8 (and stock torch.compile) on the CPU, one configuration per
process, back to back, the way the issue measured it.

    bash benchmarks/ipex_env.sh                      # once: the separate IPEX venv (~7 GB)
    python benchmarks/vs_ipex.py --models resnet50,bert-base --dtypes float32,int8 --batches 1,8

Each cell runs every peer in its own process, in rotation, --repeats times; the table gives
the median of the per-process medians and torchkiln's ratio to IPEX (>1: torchkiln faster).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import date

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_vs_ipex_worker.py")


def run(python, peer, model, dtype, batch, iters):
    cmd = [python, WORKER, "--peer", peer, "--model", model, "--dtype", dtype, "--batch", str(batch),
           "--iters", str(iters)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
    if p.returncode or line is None:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ipex-python", default=os.path.join(os.environ.get(
        "IPEX_VENV", os.path.expanduser("~/.cache/torchkiln/ipex-venv")), "bin", "python"))
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--results", help="append the table to this markdown file")
    a = ap.parse_args()
    if not os.path.exists(a.ipex_python):
        sys.exit(f"no IPEX venv at {a.ipex_python}: run `bash benchmarks/ipex_env.sh` first (or pass --ipex-python)")
    peers = [("compile", sys.executable), ("ipex", a.ipex_python), ("torchkiln", sys.executable)]
    lines = ["| model | batch | precision | torch.compile ms | IPEX 2.8 ms | torchkiln ms | torchkiln / IPEX | "
             "torchkiln served |", "|---|---|---|---|---|---|---|---|"]
    for model in a.models.split(","):
        for batch in [int(b) for b in a.batches.split(",")]:
            for dtype in a.dtypes.split(","):
                got = {p: [] for p, _ in peers}
                notes = {}
                for _ in range(a.repeats):
                    for peer, py in peers:
                        r = run(py, peer, model, dtype, batch, a.iters)
                        if "error" in r:
                            notes[peer] = r["error"]
                        else:
                            got[peer].append(r["median_ms"])
                            if peer == "torchkiln":
                                notes["served"] = r.get("served", "")
                med = {p: statistics.median(v) if v else None for p, v in got.items()}
                cell = {p: f"{v:.1f}" if v else f"failed ({notes.get(p, '')})" for p, v in med.items()}
                ratio = f"{med['ipex'] / med['torchkiln']:.2f}x" if med["ipex"] and med["torchkiln"] else "-"
                row = (f"| {model} | {batch} | {dtype} | {cell['compile']} | {cell['ipex']} | {cell['torchkiln']} | "
                       f"{ratio} | {notes.get('served', '')} |")
                print(row, flush=True)
                lines.append(row)
    text = "\n".join(lines)
    print("\n" + text)
    if a.results:
        with open(a.results, "a") as f:
            f.write(f"\n### {date.today()} `python benchmarks/vs_ipex.py {' '.join(sys.argv[1:])}`\n\n{text}\n")


if __name__ == "__main__":
    main()
