"""#11's int8 resnet50 gap to IPEX, one convolution at a time: a call of torch's oneDNN quantized conv
(what torchkiln's int8 modules candidate serves) against the oneDNN kernel time inside it.

    python benchmarks/diag_qconv_overhead.py

Times each of three resnet50 conv shapes per call, then runs itself again under ONEDNN_VERBOSE=1 and
reads oneDNN's own exec time for the same calls: the difference is what torch spends around the kernel
(output allocation, scales, primitive lookup), which IPEX's cached LLGA partitions do not pay.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch
import torch.ao.nn.quantized as nnq

SHAPES = [(64, 64, 56, 1), (512, 512, 7, 3), (2048, 512, 7, 1)]  # (in, out, spatial, kernel)


def layer(ci, co, hw, k):
    torch.manual_seed(0)
    m = nnq.Conv2d(ci, co, k, padding=k // 2)
    w = torch.quantize_per_channel(torch.randn(co, ci, k, k), torch.rand(co) * 0.01 + 1e-3,
                                   torch.zeros(co, dtype=torch.long), 0, torch.qint8)
    m.set_weight_bias(w, torch.randn(co))
    m.scale, m.zero_point = 0.05, 0
    x = torch.quantize_per_tensor(torch.rand(1, ci, hw, hw), 0.01, 0, torch.quint8)
    return m, x.contiguous(memory_format=torch.channels_last)


def calls_us() -> dict:
    """Microseconds per call of each shape's quantized conv (median of 7 runs of 200 calls)."""
    out = {}
    for shape in SHAPES:
        m, x = layer(*shape)
        for _ in range(20):
            m(x)
        per = []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(200):
                m(x)
            per.append((time.perf_counter() - t) / 200 * 1e6)
        out[shape] = statistics.median(per)
    return out


def verbose_run() -> None:
    """Under ONEDNN_VERBOSE=1: 20 marked calls per shape for the parent to read."""
    for shape in SHAPES:
        m, x = layer(*shape)
        for _ in range(20):
            m(x)
        print("MARK", shape, flush=True)
        for _ in range(20):
            m(x)
        print("END", flush=True)


def kernels_us() -> dict:
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    text = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True).stdout
    execs, shape = {}, None
    for line in text.splitlines():
        if line.startswith("MARK"):
            shape = line.split(" ", 1)[1]
        elif line.startswith("END"):
            shape = None
        elif shape and ",exec," in line and ",convolution," in line:
            execs.setdefault(shape, []).append(float(line.rsplit(",", 1)[1]) * 1e3)
    return {s: statistics.median(execs[str(s)]) if str(s) in execs else float("nan") for s in SHAPES}


def main() -> None:
    torch.backends.quantized.engine = "onednn"
    if os.environ.get("ONEDNN_VERBOSE") == "1":
        verbose_run()
        return
    calls, kernels = calls_us(), kernels_us()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| conv (in, out, spatial, kernel) | us per call | oneDNN kernel us | around the kernel us |\n|---|---|---|---|")
    for shape in SHAPES:
        print(f"| {shape} | {calls[shape]:.1f} | {kernels[shape]:.1f} | {calls[shape] - kernels[shape]:.1f} |")


if __name__ == "__main__":
    main()
