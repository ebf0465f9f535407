"""Training setup under a device-memory cap: does tk.optimize still serve a model whose bf16 step fits
but whose float32 reference step does not? GPT-2-medium bs16 seq512 (the train_step.py config).

    python benchmarks/diag_train_memory.py --cap-gib 24

With the process capped at ``--cap-gib`` (torch.cuda.set_per_process_memory_fraction): the stock step
(torch.compile + autocast bf16 + fused AdamW) trains a few steps; then tk.optimize(model, optimizer,
dtype=bfloat16) on a fresh copy, and a few of its steps. Prints each one's peak memory, the guard's
reference and what tk.optimize served.
"""

import argparse
import time
import warnings

import torch
from train_step import build

import torchkiln as tk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    a = ap.parse_args()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(a.cap_gib * 2**30 / total)
    ids = torch.randint(0, 50257, (a.batch, a.seq), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    for who in ("stock compile+autocast", "torchkiln"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = build(a.model, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        t = time.perf_counter()
        try:
            if who == "torchkiln":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16, sample_input=batch,
                                             time_budget=10)
                fn = model
            else:
                fn = torch.compile(model)
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = fn(**batch).loss
                loss.backward()
                opt.step()
            torch.cuda.synchronize()
            line = f"trained 3 steps, loss {float(loss):.3f}"
        except torch.OutOfMemoryError as e:
            import traceback

            ours = [f for f in traceback.extract_tb(e.__traceback__) if "torchkiln" in f.filename]
            where = f" in {ours[-1].filename.split('torchkiln/')[-1]}:{ours[-1].lineno} {ours[-1].name}" if ours else ""
            line = f"OUT OF MEMORY{where}: {str(e).splitlines()[0][:60]}"
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"| {who} | cap {a.cap_gib:g} GiB | peak {peak:.1f} GiB | {time.perf_counter() - t:.0f} s | {line} |",
              flush=True)
        if who == "torchkiln" and hasattr(model, "kiln_report"):
            rep = model.kiln_report
            print(f"  served: {rep.active}; guard reference: {rep.guard.get('reference')}; ok: {rep.guard.get('ok')}")
            for c in rep.candidates:
                print(f"  candidate {c.name}: {c.status} {c.reason or ''} {c.median_ms or ''}")
        del model, opt
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
