"""#11's int8 CNN: torch's quantized modules (the oneDNN int8 modules candidate) against torchkiln's
oneDNN int8 net (quantization/onednn_net.py) on the same quantized model, interleaved in one process.

    python benchmarks/diag_int8_net.py --model resnet50 --batches 1,8 --rounds 8 --iters 10

Both run the same oneDNN convolution kernels on the same int8 weights and scales; the difference is
what each spends around them. Prints median ms per call, the ratio, and how far each output is from
the pt2e graph's own (float arithmetic on the dequantized grid) and from fp32.
"""

import argparse
import statistics
import time
import warnings

import torch

import torchkiln as tk
from torchkiln import zoo
from torchkiln.quantization.onednn_int8 import OneDNNInt8
from torchkiln.quantization.onednn_net import OneDNNNet, why_not


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    if why_not():
        raise SystemExit(f"the oneDNN int8 net is unavailable here: {why_not()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| model | batch | int8 modules ms | int8 net ms | net speedup | net vs pt2e graph | modules vs pt2e graph "
          "| net vs fp32 |\n|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in a.batches.split(",")]:
        model, x = zoo.load(a.model, batch=batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = tk.quantize(model.eval(), "int8-static", calib_data=[x] * 4, sample_input=x, progress=False)
            forms = {"modules": OneDNNInt8(q), "net": OneDNNNet(q)}
        times = {k: [] for k in forms}
        with torch.no_grad():
            ref, fake = model(x), q(x)
            outs = {k: f(x) for k, f in forms.items()}
            for r in range(a.rounds):
                for k in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
                    for _ in range(2):
                        forms[k](x)
                    ts = []
                    for _ in range(a.iters):
                        t = time.perf_counter()
                        forms[k](x)
                        ts.append((time.perf_counter() - t) * 1e3)
                    times[k].append(statistics.median(ts))
        m, n = statistics.median(times["modules"]), statistics.median(times["net"])
        print(f"| {a.model} | {batch} | {m:.2f} | {n:.2f} | {m / n:.2f}x | {rel(outs['net'], fake):.4f} | "
              f"{rel(outs['modules'], fake):.4f} | {rel(outs['net'], ref):.4f} |", flush=True)


if __name__ == "__main__":
    main()
