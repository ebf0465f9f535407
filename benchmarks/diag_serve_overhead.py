"""What tk.optimize's returned model adds to each call, on top of the candidate it serves.

On the H200 (fourteenth session) four of thirteen wild-zoo models served with CUDA graphs came out
0.85-0.94x the stock reduce-overhead recipe although the served graph itself was faster: the returned
model added 67-136 us per call (weight-version check, a pytree copy of the graph's ModelOutput, a
device read of the attention mask). This times those costs on the host, where they are paid, for a
transformers encoder kept tiny so the model's own work does not drown them.

    python benchmarks/diag_serve_overhead.py [--rounds 7]

Each row is one cost (median us per call over interleaved rounds), before and after the fourteenth
session's change where it changed. "as graph-served" is the returned model on the CUDA-graph serving
path (outputs copied, weights checked after the call is queued), taken on this CPU with the flag set;
there the weight check is paid while the GPU runs, which a CPU cannot show. "serving the model as
given" is the returned model with the original itself as its served function (as when "eager" or
"eager (as given, float32)" wins), with the weight check (before) and without it (now: that candidate
runs the original's own tensors, so a weight change reaches it as is).
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

import torchkiln as tk
from torchkiln.timing import median_seconds

warnings.filterwarnings("ignore")


def tiny_encoder():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    ids = torch.randint(3, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    return tf.BertModel(cfg).eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def per_call_us(fn, n: int) -> float:
    return median_seconds(fn, warmup=0, iters=n) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=1000)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config
    import torch.utils._pytree as pytree

    from torchkiln import inputs

    model, kw = tiny_encoder()
    fast = tk.optimize(model, sample_input=kw, candidates="torchkiln")
    graph = tk.optimize(model, sample_input=kw, candidates="torchkiln")
    graph(**kw)
    graph._served.cuda_graphs = True  # the CUDA-graph serving path, on this CPU
    served, out, mask = fast._fn, fast(**kw), kw["attention_mask"]
    # The returned model serving the model as given (fifteenth session: no weight check for a candidate
    # that runs the original's own tensors), with the check (before) and without (now).
    as_given = []
    for live in (False, True):
        given = tk.optimize(model, sample_input=kw, candidates="torchkiln")
        given(**kw)
        object.__setattr__(given, "_fn", model)
        given._served.live_weights = live
        as_given.append(given)
    options = dict(fast.kiln_recipe.compile_options)

    def patch():
        with inductor_config.patch(options):
            pass

    def kept_patch():  # Compiled._patch: one patch re-entered, where torch keeps patches per thread
        with served.fn._patch():
            pass

    rows = {  # name: (what it was before this session's change, what it is now)
        "copy of the output (pytree -> inputs.clone)": (
            lambda: pytree.tree_map_only(torch.Tensor, torch.clone, out), lambda: inputs.clone(out)),
        "mask read (every call -> once per tensor)": (lambda: bool(mask.all()), lambda: served._drop_mask(kw)),
        "weight-version check": (fast._stale, None),
        "inductor config patch per compiled call": (patch, kept_patch),
        "returned model, end to end": (lambda: fast(**kw), None),
        "as graph-served, end to end": (lambda: graph(**kw), None),
        "served candidate alone": (lambda: served(**kw), None),
        "returned model serving the model as given": (lambda: as_given[0](**kw), lambda: as_given[1](**kw)),
        "the model as given alone": (lambda: model(**kw), None),
    }
    fns = {(k, i): f for k, pair in rows.items() for i, f in enumerate(pair) if f is not None}
    times: dict = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():
            for _ in range(50):
                f()
        for _ in range(a.rounds):
            for k, f in fns.items():
                times[k].append(per_call_us(f, a.calls))
    print(f"serving {fast.kiln_report.active}; torch {torch.__version__}, 1 thread, median of {a.rounds} rounds "
          f"x {a.calls} calls")
    print(f"{'cost':<46} {'before us':>10} {'now us':>10}")
    for k, pair in rows.items():
        med = [statistics.median(times[(k, i)]) if (k, i) in times else None for i in range(2)]
        now, before = (med[1], med[0]) if pair[1] is not None else (med[0], None)
        print(f"{k:<46} {before if before is None else round(before, 1)!s:>10} {now:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
