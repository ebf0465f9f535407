"""One instance of `tk.runtime.autotune(model, sample)`: load, optionally optimize, time with measure().

Run by path by the tuner (python _tuning_worker.py PAYLOAD --items N --dtype D [--no-optimize]), once
per instance of each layout, with that instance's OpenMP variables and CPU binding already set.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("payload")
    p.add_argument("--items", type=int, required=True)
    p.add_argument("--dtype", default="None")
    p.add_argument("--no-optimize", action="store_true")
    args = p.parse_args(argv)

    import torch

    from torchkiln.inputs import normalize
    from torchkiln.runtime.timed import measure

    # The file was written by autotune() in the parent a moment ago, with the user's model in it: a full
    # pickle is what carries an arbitrary nn.Module, and the file never leaves the parent's temp folder.
    payload = torch.load(args.payload, weights_only=False)
    model, sample = payload["model"], payload["sample"]
    dtype = None if args.dtype == "None" else getattr(torch, args.dtype)
    pos, kw = normalize(sample)
    model.eval()
    if not args.no_optimize:
        import torchkiln as tk

        model = tk.optimize(model, dtype=dtype, sample_input=sample)
    with torch.no_grad():
        result = measure(lambda: model(*pos, **kw), items=args.items)
    print(f"{result['items_per_s']:.2f} items/s, {result['latency_ms']:.2f} ms per call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
