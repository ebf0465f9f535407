"""DDP scaling: the same per-GPU batch on 1 and on N processes, back to back in one run, torchkiln's
training pair (`tk.optimize(DDP(model), optimizer=..., dtype=...)`) and, with --peers, the stock recipe
(torch.compile(DDP(model)), autocast, AdamW(fused=True)). Throughput is tokens/s over all ranks.

    python benchmarks/train_ddp.py --device cuda --model gpt2-medium --batch 16 --seq 512 --worlds 1,2
    python benchmarks/train_ddp.py --device cpu --model tiny --batch 4 --seq 64 --worlds 1,2 --steps 3

Each world size is its own set of processes (mp.spawn; NCCL on CUDA, gloo on CPU). Rank 0 times
--steps steps after two warm-up steps (torchkiln verifies and times its candidates in its first).

Stock variants, to see what DDP itself costs a compiled step (one process under compiled DDP ran
GPT-2-medium in 85-92 ms against 55 ms without DDP, RESULTS.md):
- ``stock``: torch.compile(DDP(model)), dynamo's DDPOptimizer splitting the graph at gradient buckets;
- ``-onegraph`` after any peer's name: ``torch._dynamo.config.optimize_ddp = False`` in its processes
  (no DDPOptimizer: one graph, every all-reduce after the whole backward);
- ``stock-inner``: DDP(torch.compile(model));
- ``nodp``: torch.compile(model), no DDP (world size 1 only: the one-GPU reference).
A peer that fails is reported with its error, and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import CONFIGS, build, make_step  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, a, out):
    import torchkiln as tk

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        low = getattr(torch, a.dtype)
        model = build(a.model, str(dev))
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), generator=g).to(dev)
        batch = {"input_ids": ids, "labels": ids}
        peer = a.peer.removesuffix("-onegraph")
        if peer != a.peer:
            torch._dynamo.config.optimize_ddp = False  # this worker process only
        if peer == "nodp":
            fast, opt = torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
        elif peer == "stock-inner":
            fast = DDP(torch.compile(model), device_ids=[rank] if cuda else None)
            opt = torch.optim.AdamW(fast.parameters(), lr=1e-5, fused=cuda)
        else:
            ddp = DDP(model, device_ids=[rank] if cuda else None)
        if peer == "torchkiln":
            fast, opt = tk.optimize(ddp, optimizer=torch.optim.AdamW(ddp.parameters(), lr=1e-5), dtype=low,
                                    sample_input=batch)
        elif peer == "stock":
            fast, opt = torch.compile(ddp), torch.optim.AdamW(ddp.parameters(), lr=1e-5, fused=cuda)
        autocast = peer != "torchkiln"

        step = make_step(fast, opt, batch, dev.type, low, autocast)

        t = time.perf_counter()
        for _ in range(2):
            step()
        warm = time.perf_counter() - t
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        if rank == 0:
            times.sort()
            report = getattr(fast, "kiln_report", None)
            with open(out, "w") as f:
                json.dump({"ms": 1e3 * times[len(times) // 2], "warm_s": warm,
                           "served": getattr(report, "active", None),
                           "candidates": [f"{c.name}: {c.status}, {c.median_ms} ms" for c in report.candidates]
                           if report is not None else []}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="gpt2-medium", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=16, help="per process")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--peers", default="torchkiln",
                    help="comma-separated: torchkiln, stock, stock-inner, nodp, each optionally -onegraph (see above)")
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    if a.device == "cuda" and max(worlds) > torch.cuda.device_count():
        raise SystemExit(f"--worlds {a.worlds}: only {torch.cuda.device_count()} GPU(s) here")
    rows = []
    for peer in a.peers.split(","):
        for world in ([1] if peer == "nodp" else worlds):
            a.peer = peer
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "r.json")
                try:
                    mp.spawn(_worker, args=(world, _free_port(), a, out), nprocs=world, join=True)
                    with open(out) as f:
                        r = json.load(f)
                except Exception as e:  # noqa: BLE001 (one peer failing leaves the others' rows)
                    print(f"  {peer} x{world}: failed: {str(e).strip().splitlines()[-1][:300]}", flush=True)
                    continue
            tokens = world * a.batch * a.seq / (r["ms"] / 1e3)
            rows.append((peer, world, r, tokens))
            print(f"  {peer} x{world}: {r['ms']:.1f} ms/step, {tokens:,.0f} tokens/s", flush=True)
            for c in r["candidates"]:
                print(f"    candidate {c}", flush=True)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"\n### {datetime.date.today()} DDP scaling {a.model} bs{a.batch}/process seq{a.seq} {a.dtype} "
          f"({name}, torch {torch.__version__})\n\nCommand: `python {' '.join(sys.argv)}` (median of "
          f"{a.steps} steps on rank 0)\n")
    print("| peer | processes | ms/step | tokens/s | vs 1 process | served |\n|---|---|---|---|---|---|")
    for peer, world, r, tokens in rows:
        ones = [t for p, w, _, t in rows if w == 1 and p in (peer, "nodp")]
        vs = f"{tokens / max(ones):.2f}x" if ones else "-"
        print(f"| {peer} | {world} | {r['ms']:.1f} | {tokens:,.0f} | {vs} | {r['served']} |")
    print("\nvs 1 process: against the faster of this peer on one process and `nodp` (no DDP), where measured.")


if __name__ == "__main__":
    main()
