"""Do CUDA graphs pay for a compiled training step? (#7's H200 1.1x)

The stock step (torch.compile + autocast bf16 + fused AdamW) ran 50.2 ms of GPU kernels in a 55.8-ms
step for GPT-2-medium bs16 seq512 on the H200 (RESULTS.md, "GPT-2-medium training on the H200"): a
tenth of the step is the GPU waiting between kernels. This times, one process, interleaved rounds,
each peer on its own copy of the model:

  stock             torch.compile(model), autocast in the loop, AdamW(fused=True)
  reduce-overhead   the same with torch.compile(mode="reduce-overhead") (inductor's CUDA graph trees)
  graphed           torch.cuda.make_graphed_callables over the compiled loss: one graph for the forward,
                    one for the backward, the loop unchanged. Not servable as it is: its backward hands
                    autograd the graph's own gradient buffers, so an accumulated .grad (two backwards, one
                    step) came out as twice the last micro-batch's (H200, thirty-ninth session; RESULTS.md)
  whole-step        forward, backward and a capturable fused AdamW step in one CUDA graph (the ceiling:
                    not servable, the user's loop calls the three itself)
  torchkiln         tk.optimize(model, optimizer=AdamW(...), dtype=bfloat16)

    python benchmarks/diag_train_graphs.py --device cuda --model gpt2-medium --batch 16 --seq 512
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
from torch import nn

from torchkiln.timing import interleaved

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from train_step import make_step, setup, step_args  # noqa: E402

PEERS = ("stock", "reduce-overhead", "graphed", "whole-step", "torchkiln")
# inductor's own knobs on the stock step (not in the default list: minutes of tuning each)
KNOBS = {"stock cdt": {"coordinate_descent_tuning": True},
         "reduce-overhead cdt": {"coordinate_descent_tuning": True, "triton.cudagraphs": True}}


class Loss(nn.Module):
    """The loop's forward as one function of tensors (make_graphed_callables takes positional tensors).
    Autocast's weight-cast cache off: a cast cached outside a capture would be replayed stale."""

    def __init__(self, model, dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, ids, labels):
        with torch.autocast("cuda", dtype=self.dtype, cache_enabled=False):
            return self.model(input_ids=ids, labels=labels).loss


def _adamw(m, **kw):
    return torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True, **kw)


def make(name, m, batch, dtype):
    ids, labels = batch["input_ids"], batch["labels"]
    if name == "stock":
        return make_step(torch.compile(m), _adamw(m), batch, "cuda", dtype, True)
    if name in KNOBS:
        return make_step(torch.compile(m, options=KNOBS[name]), _adamw(m), batch, "cuda", dtype, True)
    if name == "reduce-overhead":
        return make_step(torch.compile(m, mode="reduce-overhead"), _adamw(m), batch, "cuda", dtype, True)
    if name == "graphed":
        opt = _adamw(m)
        loss_fn = torch.cuda.make_graphed_callables(torch.compile(Loss(m, dtype)), (ids, labels))

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(ids, labels).backward()
            opt.step()
        return step
    if name == "whole-step":
        opt = _adamw(m, capturable=True)
        loss_fn = torch.compile(Loss(m, dtype))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compile, optimizer state) off the capture
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                loss_fn(ids, labels).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            loss_fn(ids, labels).backward()
            opt.step()
        return graph.replay
    if name == "torchkiln":
        import torchkiln as tk

        fast, opt = tk.optimize(m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-5), dtype=dtype,
                                sample_input=batch)
        print(f"  torchkiln serves: {fast.kiln_report.active}", flush=True)
        for c in fast.kiln_report.candidates:
            print(f"    {c.name}: {c.status} {c.median_ms} ms {c.reason or ''}", flush=True)
        return make_step(fast, opt, batch, "cuda", dtype, False)
    raise ValueError(f"peer {name!r} is not one of {PEERS + tuple(KNOBS)}")


def eval_loss(m, batch, dtype):
    """Each peer trains the same model on the same batch: after its steps the loss (eval, dropout off)
    should match the stock peer's within bf16 noise, or the graph replayed something stale."""
    m.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        loss = m(**batch).loss.float().item()
    m.train()
    return loss


def main():
    ap = step_args(40.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--peers", default=",".join(PEERS))
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    base, batch = setup(a)
    steps, models, errors = {}, {}, {}
    for name in a.peers.split(","):
        t = time.perf_counter()
        try:
            models[name] = copy.deepcopy(base)
            steps[name] = make(name, models[name], batch, dtype)
            for _ in range(3):
                steps[name]()
            torch.cuda.synchronize()
        except Exception as e:  # report and go on: the point is which forms work at all
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            steps.pop(name, None)
            models.pop(name, None)
            print(f"  {name}: FAILED {errors[name]}", flush=True)
            continue
        print(f"  built {name} ({time.perf_counter() - t:.1f} s with 3 steps)", flush=True)
    # the same number of steps for every peer before the losses are compared: each step function
    # ran 3 times above; the interleaved timing then calls each the same number of rounds
    times = interleaved(steps, dev, a.budget, min_rounds=8, prune=100)
    med = {n: statistics.median(t) for n, t in times.items()}
    tokens = a.batch * a.seq
    base_ms = med.get("stock")
    print(f"\n{a.model} bs{a.batch} seq{a.seq} {a.dtype} on {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}; {min(len(t) for t in times.values())} interleaved rounds, medians\n")
    print("| peer | ms/step | tokens/s | x stock | eval loss after its steps (steps) |\n|---|---|---|---|---|")
    for n, m in sorted(med.items(), key=lambda kv: kv[1]):
        loss = eval_loss(models[n], batch, dtype)
        print(f"| {n} | {1e3 * m:.2f} | {tokens / m:,.0f} | "
              f"{(base_ms / m if base_ms else float('nan')):.3f} | {loss:.4f} ({3 + len(times[n])}) |")
    for n, e in errors.items():
        print(f"| {n} | failed: {e} | | | |")


if __name__ == "__main__":
    main()
