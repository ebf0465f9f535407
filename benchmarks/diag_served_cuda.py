"""Where the returned model's time goes on CUDA, beside the stock reduce-overhead recipe.

wild_zoo on the H200 (fourteenth session) found torchkiln's CUDA-graph model slower than stock
`torch.compile(mode="reduce-overhead")` on some models although optimize() had measured its graph
faster. This prints each model's optimize() report (what selection measured), then times, per call
with a device sync after each (so the GPU is idle at each start, as in tk.bench), in 3 interleaved rounds (best round kept):

  fast()            the returned model, as the user calls it
  served fn         the candidate optimize() serves, called directly (no copy of its outputs)
  served fn+clone   the same with the copy the returned model made of graph-pool outputs (pytree)
  served fn+inputs.clone   ... and with the copy it makes since the fourteenth session
  stock ro          the stock recipe, built as optimize() builds its candidate
  stale             the returned model's weight-version check alone
  mask all          reading whether the attention mask is all ones (a device sync)
  mask kept         the served candidate's mask decision, kept for the same unchanged mask tensor

    python benchmarks/diag_served_cuda.py deberta,t5-encoder,mobilenet-v2,roberta   # wild_zoo names
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

import torchkiln as tk
from torchkiln import inputs, stock
from torchkiln.timing import median_seconds

sys.path.insert(0, str(Path(__file__).parent))
import wild_zoo  # noqa: E402

warnings.filterwarnings("ignore")


def per_call_ms(f, n: int = 300) -> float:
    """With a device sync after each call (the one before is the previous call's)."""
    return round(median_seconds(lambda: (f(), torch.cuda.synchronize()), warmup=20, iters=n) * 1e3, 4)


def case(name: str, dev: torch.device) -> None:
    model, sample = wild_zoo.MODELS[name]()
    model = model.cuda().eval()
    fast = tk.optimize(model, dtype=torch.bfloat16, sample_input=sample, device="cuda")
    print(f"=== {name}\n{fast.kiln_report}", flush=True)
    args, kwargs = inputs.to(inputs.normalize(sample), dev)
    fn = fast._fn
    r = next(r for r in stock.compile_recipes(dev, torch.bfloat16) if r.name.endswith("cast reduce-overhead"))
    peer = stock.build(r, model, dev)
    peer(*args, **kwargs)
    mask = kwargs.get("attention_mask")
    rows = {"fast()": lambda: fast(*args, **kwargs), "served fn": lambda: fn(*args, **kwargs),
            "served fn+clone": lambda: inputs.tree_map(torch.clone, fn(*args, **kwargs)),
            "served fn+inputs.clone": lambda: inputs.clone(fn(*args, **kwargs)),
            "stock ro": lambda: peer(*args, **kwargs), "stale": fast._stale,
            "mask all": lambda: bool(mask.all()) if mask is not None else None,
            "mask kept": lambda: fn._drop_mask(kwargs) if hasattr(fn, "_drop_mask") else None}
    res: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(3):
        for k, f in rows.items():
            res[k].append(per_call_ms(f))
    print(name, {k: min(v) for k, v in res.items()}, flush=True)


def main(names: list[str]) -> None:
    torch.set_grad_enabled(False)
    for name in names:
        case(name, torch.device("cuda"))
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1].split(","))
