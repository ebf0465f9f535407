"""Host memory (RSS) of a process that optimizes a model on the CPU, against the stock recipe's.

    python benchmarks/diag_host_memory.py --model bert-base --dtype bfloat16
    python benchmarks/diag_host_memory.py --llm llama-1b --dtype bfloat16 [--from-dtype float32]
    python benchmarks/diag_host_memory.py --model bert-base --dtype bfloat16 --limit-gib 0.6

--limit-gib G: tk.optimize sees G GiB available above what the process held before it (MemAvailable
faked from the process's own resident size, so the memory freed during the selection counts, as a
container limit would see it); peers: torchkiln, torchkiln as it was before candidates were freed to
make room (those that did not fit were skipped), and the stock recipe. Prints what each built and served.

Each peer runs in its own fresh process (the peak, ru_maxrss, is per process): the model is built and
called once, then the peer is built and called. Printed in GiB: resident before the peer, resident
after it, and the process's peak. Peers: --model: tk.optimize(model, dtype=..., sample_input=...) and
torch.compile with freezing (under autocast for a low dtype); --llm: tk.llm.optimize copying the
model (the default) and with inplace=True.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import warnings

import torch


def rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**30


def peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_peer(a) -> dict:
    import torchkiln as tk

    warnings.filterwarnings("ignore")
    dtype = getattr(torch, a.dtype)
    if a.llm:
        from torchkiln.llm.bench import build

        src = getattr(torch, a.from_dtype or a.dtype)
        torch.set_default_dtype(src)  # built straight in its dtype: no float32 model on the way
        model = build(a.llm, torch.device("cpu"), src)
        torch.set_default_dtype(torch.float32)
        before, top = rss(), peak()
        fast = tk.llm.optimize(model, dtype=dtype, compile=False, inplace=a.peer == "inplace")
        fast.generate(torch.randint(3, 1000, (1, 8)), max_new_tokens=2, pad_token_id=0)
    else:
        from torchkiln import zoo

        model, x = zoo.load(a.model, batch=1)
        model.eval()
        call = (lambda f: f(**x)) if isinstance(x, dict) else (lambda f: f(x))
        with torch.no_grad():
            call(model)
        before, top = rss(), peak()
        if a.limit_gib is not None:
            from torchkiln import hostmem

            hostmem.available_bytes = lambda *_, **__: max(0, int((a.limit_gib - (rss() - before)) * 2**30))
        if a.peer == "torchkiln-skip":  # before _make_room: what did not fit was skipped
            from torchkiln.optimize import KilnModule

            KilnModule._make_room = lambda *_, **__: False
        if a.peer.startswith("torchkiln"):
            fast = tk.optimize(model, dtype=dtype, sample_input=x)
        else:
            from torchkiln.passes.compile import compile_model

            fast = compile_model(model, {"freezing": True})
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32 and
                                             a.peer == "stock"):
            call(fast)
    r = {"before": before, "after": rss(), "peak": peak(), "peak_before": top}
    if not a.llm and a.peer.startswith("torchkiln"):
        ms = fast.kiln_report.candidates
        r["served"] = f"{fast.kiln_report.active} ({next(m.median_ms for m in ms if m.status == 'served')} ms)"
        r["skipped"] = ", ".join(m.name for m in ms if m.status == "skipped") or "-"
        r["freed"] = ", ".join(m.name for m in ms if "freed to make room" in (m.reason or "")) or "-"
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--llm", default=None, help="a tk.llm bench config (llama-125m, llama-1b, ...)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--from-dtype", default=None, help="--llm: the dtype the model is built in (default: --dtype)")
    ap.add_argument("--limit-gib", type=float, default=None, help="GiB available to tk.optimize above the model")
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # set in the child processes
    a = ap.parse_args()
    if a.peer:
        print(json.dumps(run_peer(a)))
        return
    peers = ("copy", "inplace") if a.llm else \
        ("torchkiln", "torchkiln-skip", "stock") if a.limit_gib is not None else ("torchkiln", "stock")
    what = f"{a.llm} {a.from_dtype or a.dtype} -> {a.dtype}" if a.llm else f"{a.model} {a.dtype}"
    print(f"| {what} | resident before GiB | after | process peak | served | skipped | freed |\n|---|---|---|---|---|---|---|")
    for p in peers:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--peer", p], capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {p} | {r['before']:.2f} | {r['after']:.2f} | {r['peak']:.2f} | {r.get('served', '')} | "
              f"{r.get('skipped', '')} | {r.get('freed', '')} |")


if __name__ == "__main__":
    main()
