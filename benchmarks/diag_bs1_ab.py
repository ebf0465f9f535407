"""bert-base bs1 on a GPU, torchkiln's returned model against the stock reduce-overhead peer, timed
as tk.bench times them (a synchronised call each, interleaved rounds; bench._time). One line per
process: run it alternately with two torchkiln trees on PYTHONPATH for an A/B of a host-side change,
e.g. with the tree of an older commit exported to /tmp/old (``git archive REV torchkiln | tar -x -C /tmp/old``):

    for t in /tmp/old $PWD /tmp/old $PWD; do PYTHONPATH=$t python benchmarks/diag_bs1_ab.py; done
"""

from __future__ import annotations

import copy
import importlib
import statistics

import torch

import torchkiln as tk
from torchkiln import inputs, zoo


def main() -> None:
    bench = importlib.import_module("torchkiln.bench")
    dev = torch.device("cuda")
    model, sample = zoo.load("bert-base", batch=1)
    model = model.to(dev).eval()
    args, kwargs = inputs.to(inputs.normalize(sample), dev)
    peer = bench.peers_for(dev, torch.bfloat16)["compile bf16-cast reduce-overhead"].build(copy.deepcopy(model))
    fns = {"reduce-overhead": peer, "torchkiln": tk.optimize(model, dtype=torch.bfloat16, sample_input=sample,
                                                            device=dev)}
    times: dict[str, list[float]] = {n: [] for n in fns}
    with torch.no_grad():
        for f in fns.values():
            for _ in range(5):
                f(*args, **kwargs)
        for _ in range(12):
            for n, f in fns.items():
                times[n] += bench._time(f, args, kwargs, dev, warmup=1, iters=6)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(tk.__file__, ", ".join(f"{n} {m:.3f} ms" for n, m in med.items()),
          f"ratio {med['reduce-overhead'] / med['torchkiln']:.3f}")


if __name__ == "__main__":
    main()
