"""torchkiln against IPEX 2.8 (and stock torch.compile) on the CPU.

    bash benchmarks/ipex_env.sh                      # once: the separate IPEX venv (~7 GB)
    python benchmarks/vs_ipex.py --models resnet50,bert-base --dtypes float32,int8 --batches 1,8

IPEX needs its own torch (2.8), so each peer lives in its own process. Per cell the peers are
built one after another (no overlap), then timed *interleaved*: --rounds rounds, each asking every
peer's process for --iters calls in turn (the order rotates per round), while the others wait
idle on a pipe. The table gives the median of per-round medians, and torchkiln's ratio to IPEX as
the median of the per-round paired ratios (>1: torchkiln faster). Pairing matters here: on this
shared machine one process-after-another run measured IPEX 65 ms and then 78 ms for the same
model minutes apart, a drift larger than the gap being measured.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_vs_ipex_worker.py")


class Peer:
    """One peer's served worker process."""

    def __init__(self, name, python, model, dtype, batch):
        self.name, self.error, self.info = name, None, {}
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr to a file: a full pipe would block the worker
        cmd = [python, WORKER, "--peer", name, "--model", model, "--dtype", dtype, "--batch", str(batch)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.info = self._reply()

    def _reply(self):
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.log.seek(0)
        tail = (self.log.read().strip().splitlines() or ["no output"])[-1][:200]
        self.error = tail
        return None

    def run(self, iters):
        if self.error:
            return None
        self.proc.stdin.write(f"run {iters}\n")
        self.proc.stdin.flush()
        r = self._reply()
        return r["median_ms"] if r else None

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            self.proc.wait(timeout=60)
        self.log.close()


def cell(peers_py, model, dtype, batch, rounds, iters):
    peers = []
    for name, py in peers_py:  # built one at a time: compiles must not overlap the others
        peers.append(Peer(name, py, model, dtype, batch))
    per_round = {p.name: [] for p in peers}
    for r in range(rounds):
        order = peers[r % len(peers):] + peers[:r % len(peers)]
        for p in order:
            time.sleep(0.05)  # let the previous process's OpenMP threads stop spinning
            per_round[p.name].append(p.run(iters))
    for p in peers:
        p.close()
    errors = {p.name: p.error for p in peers if p.error}
    served = next((p.info.get("served", "") for p in peers if p.name == "torchkiln" and p.info), "")
    return per_round, errors, served


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ipex-python", default=os.path.join(os.environ.get(
        "IPEX_VENV", os.path.expanduser("~/.cache/torchkiln/ipex-venv")), "bin", "python"))
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--iters", type=int, default=8, help="calls per peer per round")
    ap.add_argument("--peers", default="compile,ipex,torchkiln", help="which of compile,ipex,torchkiln to run")
    ap.add_argument("--results", help="append the table to this markdown file")
    a = ap.parse_args()
    pythons = {"compile": sys.executable, "ipex": a.ipex_python, "torchkiln": sys.executable}
    wanted = a.peers.split(",")
    bad = [p for p in wanted if p not in pythons]
    if bad:
        sys.exit(f"--peers: unknown peer(s) {bad}; choose from {sorted(pythons)}")
    if "ipex" in wanted and not os.path.exists(a.ipex_python):
        sys.exit(f"no IPEX venv at {a.ipex_python}: run `bash benchmarks/ipex_env.sh` first (or pass --ipex-python)")
    lines = ["| model | batch | precision | torch.compile ms | IPEX 2.8 ms | torchkiln ms | torchkiln / IPEX "
             "(paired rounds: median [min-max]) | torchkiln served |", "|---|---|---|---|---|---|---|---|"]
    for model in a.models.split(","):
        for batch in [int(b) for b in a.batches.split(",")]:
            for dtype in a.dtypes.split(","):
                got, errors, served = cell([(p, pythons[p]) for p in wanted], model, dtype, batch, a.rounds, a.iters)
                med = {p: statistics.median([v for v in vs if v is not None]) if any(v is not None for v in vs)
                       else None for p, vs in got.items()}
                cells = {p: f"{med[p]:.1f}" if med.get(p) else (f"failed ({errors[p]})" if p in errors else "not run")
                         for p in pythons}
                pairs = [i / t for i, t in zip(got.get("ipex", []), got.get("torchkiln", []), strict=False) if i and t]
                ratio = (f"{statistics.median(pairs):.2f}x [{min(pairs):.2f}-{max(pairs):.2f}]" if pairs else "-")
                row = (f"| {model} | {batch} | {dtype} | {cells['compile']} | {cells['ipex']} | {cells['torchkiln']} | "
                       f"{ratio} | {served} |")
                print(row, flush=True)
                lines.append(row)
    text = "\n".join(lines)
    print("\n" + text)
    if a.results:
        with open(a.results, "a") as f:
            f.write(f"\n### {date.today()} `python benchmarks/vs_ipex.py {' '.join(sys.argv[1:])}`\n\n{text}\n")


if __name__ == "__main__":
    main()
