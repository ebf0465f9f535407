"""A full training step (forward, backward, optimizer step), torchkiln against the
stock recipes, interleaved; prints ratios, tokens/s and MFU.

On a CPU each peer runs in a process of its own (built one after another, then one step of
each per round, the idle ones waiting on a pipe): torchkiln's CPU plan changes process-wide
malloc settings (runtime/allocator.py), which stock peers in the same process would get for
free. --same-process builds them all here, as before.

    python benchmarks/train_step.py --device cpu  --model bert-base   --batch 8  --seq 128
    python benchmarks/train_step.py --device cuda --model gpt2-medium --batch 16 --seq 512

Peers, each on its own copy of the model:
  eager fp32          the loop as written, AdamW (torch's default, foreach)
  compile+autocast    torch.compile(model), autocast in the loop, AdamW(fused=True)
  compile+autocast reduce-overhead  the same compiled with mode="reduce-overhead" (CUDA graphs)
  compile+autocast malloc-keep  the same in a process where glibc malloc keeps freed memory (set by
                      hand: what preloading jemalloc, as `torchkiln run` and torch's run_cpu do, gives)
  compile fp32        the same without autocast (the stock choice on a CPU without native bf16)
  torchkiln           tk.optimize(model, optimizer=AdamW(...), dtype=...), the loop unchanged
  torchkiln split     the same with split_master_weight_for_bf16=True (bf16 weights, exact fp32 masters)
  torchkiln malloc-default  the same with cpu_allocator="default" (glibc malloc left as it is)

On CUDA, --memory reports each peer's peak allocated memory over what was allocated before it was
built: while building (tk.optimize's verification and timing included) and the first step, and over
two later steps (the model, gradients, optimizer state and activations of the loop).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time

import torch

import torchkiln as tk
from torchkiln.bench import gemm_peak
from torchkiln.timing import interleaved

CONFIGS = {  # transformers config class, model class, config overrides (random init, no download)
    "bert-base": ("BertConfig", "BertForMaskedLM", {}),
    "bert-large": ("BertConfig", "BertForMaskedLM", {"hidden_size": 1024, "num_hidden_layers": 24,
                                                     "num_attention_heads": 16, "intermediate_size": 4096}),
    "gpt2-medium": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "tiny": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_layer": 2, "n_head": 2}),  # script checks
}


def build(name: str, device: str):
    import transformers

    cfg_cls, model_cls, over = CONFIGS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(attn_implementation="sdpa", **over)
    return getattr(transformers, model_cls)(cfg).to(device).train()


def make_step(model, opt, batch: dict, device_type: str, dtype: torch.dtype, autocast: bool):
    """One training step as a user's loop writes it (the model computes its own loss from labels)."""
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
    return step


def step_args(budget: float) -> argparse.ArgumentParser:
    """The arguments every training-step script takes: where, which model, what batch, how long."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="bert-base", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget", type=float, default=budget, help="seconds of interleaved timing")
    return ap


def makers_for(a, batch: dict, low: torch.dtype, notes: dict) -> dict:
    """name -> a function that turns a copy of the model into that peer's step."""
    dev = torch.device(a.device)
    want = a.peers.split(",")

    def stepper(model, opt, autocast):
        return make_step(model, opt, batch, dev.type, low, autocast)

    makers = {}
    if "eager fp32" in want:
        makers["eager fp32"] = lambda m: stepper(m, torch.optim.AdamW(m.parameters(), lr=1e-5), False)
    if "compile+autocast" in want:
        makers[f"compile+autocast {a.dtype} +fused AdamW"] = lambda m: stepper(
            torch.compile(m), torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True), True)
    if "compile+autocast reduce-overhead" in want:  # the stock way to CUDA graphs (a loop without accumulation)
        makers[f"compile reduce-overhead+autocast {a.dtype} +fused AdamW"] = lambda m: stepper(
            torch.compile(m, mode="reduce-overhead"), torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True), True)
    if "compile+autocast malloc-keep" in want:  # the stock recipe with jemalloc-like reuse (its own process)
        def keep(m):
            from torchkiln.runtime import allocator

            allocator.keep_freed_memory()
            return stepper(torch.compile(m), torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True), True)
        makers[f"compile+autocast {a.dtype} +fused AdamW, malloc keeps freed memory"] = keep
    if "compile fp32" in want:  # the stock peer where bf16 is not native (emulated bf16 is far slower)
        makers["compile fp32 +fused AdamW"] = lambda m: stepper(
            torch.compile(m), torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True), False)
    for name, knobs in (("torchkiln", {}), ("torchkiln split", {"split_master_weight_for_bf16": True}),
                        ("torchkiln malloc-default", {"cpu_allocator": "default"})):
        if name in want:
            def make(m, name=name, knobs=knobs):
                fast, opt = tk.optimize(m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-5), dtype=low,
                                        sample_input=batch, **knobs)
                notes[name] = str(fast.kiln_report)
                return stepper(fast, opt, False)
            makers[name] = make
    return makers


def setup(a):
    """The model and batch every peer starts from (the same seeds in every process)."""
    dev = torch.device(a.device)
    base = build(a.model, a.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (a.batch, a.seq), generator=g).to(dev)
    return base, {"input_ids": ids, "labels": ids}


def _worker(conn, a, name):
    """One peer in a process of its own: build, warm up, then one step per request."""
    base, batch = setup(a)
    notes = {}
    step = makers_for(a, batch, getattr(torch, a.dtype), notes)[name](base)
    t = time.perf_counter()
    for _ in range(2):
        step()
    conn.send((time.perf_counter() - t, notes.get(name)))
    while conn.recv() == "step":
        step()
        conn.send(None)


class Isolated:
    """A peer's step in its own process. Why: tk.optimize's CPU training plan sets process-wide
    state (glibc malloc keeps freed memory, runtime/allocator.py) that stock peers in the same
    process would share; a user running the stock recipe has no such setting."""

    def __init__(self, a, name):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, a, name), daemon=True)
        self.proc.start()

    def ready(self):
        return self.conn.recv()  # (warm-up seconds, report text)

    def __call__(self):
        self.conn.send("step")
        self.conn.recv()

    def close(self):
        self.conn.send("stop")
        self.proc.join(60)


def main():
    ap = step_args(30.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--peers", default="eager fp32,compile+autocast,torchkiln")
    ap.add_argument("--memory", action="store_true", help="CUDA: each peer's peak memory while building and training (see above)")
    ap.add_argument("--same-process", action="store_true",
                    help="CPU: build every peer in this process (default: one process per peer, see Isolated)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    low = getattr(torch, a.dtype)
    base, batch = setup(a)
    n_params = sum(p.numel() for p in base.parameters())
    steps, notes = {}, {}
    t0 = time.perf_counter()
    makers = makers_for(a, batch, low, notes)
    isolate = dev.type == "cpu" and not a.same_process
    if not isolate and any("malloc" in n for n in makers):
        sys.exit("the malloc peers change process-wide settings: run them without --same-process, on a CPU")
    if isolate:  # built one after another, so no two compile at once on the timed cores
        for name in makers:
            steps[name] = Isolated(a, name)
            warm, notes[name] = steps[name].ready()
            print(f"  built {name} in its own process ({warm:.1f} s warm-up)", flush=True)
            if notes[name] is None:
                del notes[name]
        makers = {}
    memory = {}  # name -> (peak during optimize and the first step, peak over two later steps), GiB
    cuda = a.memory and dev.type == "cuda"
    for name, make in makers.items():
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        steps[name] = make(copy.deepcopy(base))
        if cuda:  # measured while the peers built before stay resident: deltas over what was there
            steps[name]()
            torch.cuda.synchronize()
            first = torch.cuda.max_memory_allocated() - before
            torch.cuda.reset_peak_memory_stats()
            for _ in range(2):
                steps[name]()
            torch.cuda.synchronize()
            memory[name] = (first / 2**30, (torch.cuda.max_memory_allocated() - before) / 2**30)
            print(f"  {name}: peak {memory[name][0]:.2f} GiB building, {memory[name][1]:.2f} GiB training",
                  flush=True)
    for name, s in ({} if isolate else steps).items():  # compile and warm up outside the clock (done there)
        t = time.perf_counter()
        for _ in range(2):
            s()
        print(f"  built {name} ({time.perf_counter() - t:.1f} s warm-up)", flush=True)
    times = interleaved(steps, dev, a.budget, min_rounds=5, prune=100)
    med = {n: statistics.median(t) for n, t in times.items()}
    tokens = a.batch * a.seq
    # Training FLOPs: 6 per parameter per token (forward 2, backward 4), attention left out.
    flops = 6 * n_params * tokens
    try:
        peak, peak_dtype = gemm_peak(low, dev) * 1e9, a.dtype
    except RuntimeError:  # no bf16 GEMM on this CPU (AVX2): MFU against the fp32 peak
        peak, peak_dtype = gemm_peak(torch.float32, dev) * 1e9, "float32"
    lines = [f"\n### {datetime.date.today()} train step {a.model} bs{a.batch} seq{a.seq} on {dev.type} "
             f"({torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}, torch {torch.__version__})",
             f"\nCommand: `python {' '.join(sys.argv)}` ({n_params / 1e6:.0f}M parameters; {len(times['torchkiln'] if 'torchkiln' in times else next(iter(times.values())))} "  # noqa: E501
             f"interleaved rounds; measured {peak_dtype} GEMM peak {peak / 1e12:.1f} TFLOP/s)\n",
             "| peer | ms/step | tokens/s | MFU (vs measured GEMM peak) | x eager fp32 | peak GiB building / training |",
             "|---|---|---|---|---|---|"]
    ref = med.get("eager fp32")
    for n, m in sorted(med.items(), key=lambda kv: kv[1]):
        lines.append(f"| {n} | {1e3 * m:.1f} | {tokens / m:,.0f} | {flops / m / peak:.1%} | "
                     + (f"{ref / m:.2f}x |" if ref else "- |")
                     + (f" {memory[n][0]:.2f} / {memory[n][1]:.2f} |" if n in memory else " - |"))
    if "torchkiln" in med:
        peers = {n: m for n, m in med.items() if not n.startswith("torchkiln")}
        if peers:
            best = min(peers, key=peers.get)
            lines.append(f"\ntorchkiln vs best stock peer ({best}): {peers[best] / med['torchkiln']:.2f}x")
    print("\n".join(lines))
    for n, txt in notes.items():
        print(f"\n{n} report:\n{txt}")
    for s in steps.values():
        if isinstance(s, Isolated):
            s.close()
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
