"""What dropout costs a compiled training step, and what hash_dropout gives back.

    python benchmarks/diag_train_dropout.py --model bert-base --batch 8 --seq 128 --budget 60
    python benchmarks/diag_train_dropout.py --device cuda --model gpt2-medium --batch 16 --seq 512

Three builds of the stock step (torch.compile + autocast bf16 + fused AdamW), each on its own
copy of the model, interleaved in one process:
  stock         as a user writes it (inductor's dropout: a Philox evaluation per element)
  hash_dropout  the same, with torchkiln's hash_dropout graph pass as inductor's pre-grad pass
  no dropout    every dropout probability set to 0: the ceiling for any dropout speedup
"""

from __future__ import annotations

import copy
import statistics

import torch
from train_step import build, make_step, step_args

from torchkiln.passes.hash_dropout import HashDropoutPass
from torchkiln.timing import interleaved


def no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "dropout_prob", None), float):  # transformers' attention modules
            m.dropout_prob = 0.0
    return model


def main():
    a = step_args(60.0).parse_args()
    dev = torch.device(a.device)
    base = build(a.model, a.device)
    ids = torch.randint(0, base.config.vocab_size, (a.batch, a.seq), device=dev)
    batch = {"input_ids": ids, "labels": ids}
    # The planner installs it on CPUs only; on CUDA, SDPA's dropout stays inside its flash kernel.
    hashed = HashDropoutPass(devices=(dev.type,), attention=dev.type == "cpu")
    builds = {"stock": (lambda m: m, None), "hash_dropout": (lambda m: m, {"pre_grad_custom_pass": hashed}),
              "no dropout": (no_dropout, None)}
    steps = {}
    for name, (prep, opts) in builds.items():
        m = prep(copy.deepcopy(base))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
        steps[name] = make_step(torch.compile(m, options=opts), opt, batch, dev.type, torch.bfloat16, True)
        for _ in range(2):  # compile, then one warm step
            steps[name]()
    times = interleaved(steps, dev, a.budget)
    med = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    print(f"{a.model} bs{a.batch} seq{a.seq}, {a.device}, torch {torch.__version__}; {hashed.rewritten} dropout sites "
          f"rewritten; medians of {min(len(t) for t in times.values())}+ interleaved steps")
    print("| build | ms/step | x stock |\n|---|---|---|")
    for n, ms in med.items():
        print(f"| {n} | {ms:.1f} | {med['stock'] / ms:.2f}x |")


if __name__ == "__main__":
    main()
