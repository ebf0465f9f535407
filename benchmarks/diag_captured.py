"""torchkiln's CUDA-graph candidates side by side, as tk.optimize's selection timed them (one process,
interleaved rounds, medians): the compiled model without graphs, through inductor's CUDA-graph trees,
and replayed from graphs torchkiln captures itself (torchkiln/captured.py), with the stock peers.

    python benchmarks/diag_captured.py --case bert-base:1 --case bert-base:64 --case resnet50:256 --budget 6
"""

import argparse

import torch

import torchkiln as tk
from torchkiln import candidates, inputs, zoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=None, help="MODEL:BATCH (repeatable)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=float, default=6.0, help="the selection's time_budget, seconds")
    a = ap.parse_args()
    candidates.TREES_BESIDE_CAPTURED = True  # optimize skips the trees where the captured graphs serve
    dtype = getattr(torch, a.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.dtype}, time_budget {a.budget} s")
    for case in a.case or ["bert-base:1", "bert-base:64", "resnet50:256"]:
        name, batch = case.split(":")
        model, x = zoo.load(name, batch=int(batch))
        model = model.cuda().eval()
        args, kwargs = inputs.to(inputs.normalize(x), "cuda")
        fast = tk.optimize(model, dtype=dtype, sample_input=args if args else kwargs, time_budget=a.budget)
        rep = tk.report(fast)
        timed = sorted((m for m in rep.candidates if m.median_ms is not None), key=lambda m: m.median_ms)
        mine = {m.name: m.median_ms for m in timed}
        trees = next((v for k, v in mine.items() if k.endswith("+ CUDA graphs") and k.startswith("torchkiln")), None)
        print(f"\n{name} bs{batch}: served {rep.active}\n| candidate | median ms | vs trees |\n|---|---|---|")
        for m in timed:
            print(f"| {m.name} | {m.median_ms:.3f} | {trees / m.median_ms:.2f}x |" if trees else
                  f"| {m.name} | {m.median_ms:.3f} | - |")
        del fast, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
