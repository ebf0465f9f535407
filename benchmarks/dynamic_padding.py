"""Padding per batch: a stream of batches whose sequence length changes at every batch, as
``tokenizer(texts, padding=True)`` gives, through eager, the stock torch.compile recipes and
tk.optimize, in one process:

    python benchmarks/dynamic_padding.py [--config minilm] [--dtype float32] [--batch 16] [--rounds 5]

Two phases per peer:
- cold: the first pass over the stream, compiles included, peers one after another (a compile
  cannot be interleaved); the wall time and the slowest call;
- warm: passes over the same stream in interleaved rounds, median seconds per pass.
Ratios are against torchkiln (> 1: torchkiln faster). The stock peers are torchkiln.stock's compile
recipes for the device and dtype (on CPU freezing, under autocast or cast for bf16; on CUDA also
``reduce-overhead``), each built the way its tutorial says.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import torchkiln as tk
from torchkiln import stock

CONFIGS = {  # random-initialised from transformers' BertConfig
    "minilm": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536},
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}


def stream(batch: int, lengths: list[int], device: str) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(1000, 20000, (batch, n), generator=g)
        mask = torch.ones_like(ids)
        for row in range(1, batch, 2):  # half the rows padded, as a real batch of mixed lengths is
            mask[row, int(torch.randint(n // 2, n, (1,), generator=g)):] = 0
        out.append({"input_ids": ids.to(device), "attention_mask": mask.to(device)})
    return out


def timed(fn, batches, device: str) -> tuple[float, float]:
    """Seconds for one pass over ``batches`` and the slowest call."""
    slowest = 0.0
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for b in batches:
            t = time.perf_counter()
            fn(**b)
            if device == "cuda":
                torch.cuda.synchronize()
            slowest = max(slowest, time.perf_counter() - t)
    return time.perf_counter() - start, slowest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="minilm")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lengths", default="48,37,61,29,88,52,70,33,95,44,120,57",
                    help="sequence length of each batch in the stream, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peers", default="", help="comma-separated stock peer names to keep (default: all)")
    a = ap.parse_args()
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(**CONFIGS[a.config])).eval().to(a.device)
    dtype = getattr(torch, a.dtype)
    lengths = [int(n) for n in a.lengths.split(",")]
    batches = stream(a.batch, lengths, a.device)
    dev = torch.device(a.device)
    cast = stock.SharedCast(model)
    eager = stock.AS_GIVEN if dtype == torch.float32 else stock.eager_recipes(dtype)[1 if dev.type == "cpu" else 0]
    recipes = [eager, *stock.compile_recipes(dev, dtype)]
    if a.peers:
        recipes = [r for r in recipes if r.name in a.peers.split(",")]
    peers = {r.name: stock.build(r, model, dev, cast=cast) for r in recipes}
    cold: dict[str, tuple[float, float]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        fast = tk.optimize(model, dtype=dtype, sample_input=batches[0])
        optimize_s = time.perf_counter() - t  # the first batch's call is made here
        total, slowest = timed(fast, batches, a.device)
        cold["torchkiln"] = (total + optimize_s, max(slowest, optimize_s))
        for name, fn in peers.items():
            cold[name] = timed(fn, batches, a.device)
        peers["torchkiln"] = fast
        warm: dict[str, list[float]] = {n: [] for n in peers}
        for _ in range(a.rounds):
            for name, fn in peers.items():
                warm[name].append(timed(fn, batches, a.device)[0])
    med = {n: statistics.median(v) for n, v in warm.items()}
    print(f"\n{a.config} {a.dtype} on {a.device}, batch {a.batch}, {len(lengths)} lengths {lengths}; "
          f"served: {tk.report(fast).active}")
    print("| peer | cold pass s (compiles included) | slowest cold call s | warm pass ms (median) "
          "| warm: torchkiln x |")
    print("|---|---|---|---|---|")
    for name in peers:
        ratio = med[name] / med["torchkiln"]
        print(f"| {name} | {cold[name][0]:.1f} | {cold[name][1]:.2f} | {med[name] * 1e3:.1f} | "
              f"{'' if name == 'torchkiln' else f'{ratio:.2f}x'} |")


if __name__ == "__main__":
    main()
