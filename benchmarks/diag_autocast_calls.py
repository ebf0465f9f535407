"""IPEX's bf16 recipes call the optimized model under the caller's autocast:
``ipex.optimize(model, dtype=torch.bfloat16)`` then ``with torch.no_grad(), torch.cpu.amp.autocast():
model(x)``, and run_generation.py's ``generate`` under autocast and ``torch.inference_mode()``. What the
first call under inference mode, then under autocast, costs (a recompile of the served graph each, before
torchkiln served them out of those contexts), the steady call time under and outside autocast, eager under
autocast for scale, and tk.llm's generate:

    python benchmarks/diag_autocast_calls.py [--model bert-base] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import torchkiln as tk
from torchkiln import zoo


def first(o):
    return o[0] if isinstance(o, (tuple, list)) else getattr(o, "last_hidden_state", o)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    m, x = zoo.load(a.model, batch=1)
    call = (lambda f: f(**x)) if isinstance(x, dict) else (lambda f: f(x))
    fast = tk.optimize(m, dtype=torch.bfloat16, sample_input=x)
    print(str(tk.report(fast)).splitlines()[0])
    ac = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with torch.inference_mode():
        t = time.perf_counter()
        call(fast)
        print(f"first call under inference_mode: {time.perf_counter() - t:.2f} s")
    with torch.no_grad():
        ref = first(call(m)).float()
        with ac():
            t = time.perf_counter()
            o = first(call(fast))
            print(f"first call under autocast: {time.perf_counter() - t:.2f} s, rel err vs fp32 "
                  f"{float((o.float() - ref).norm() / ref.norm()):.4f}")
        ts = {"torchkiln under autocast": [], "torchkiln outside": [], "eager under autocast": []}
        for _ in range(a.rounds):  # interleaved
            for name, f, on in (("torchkiln under autocast", fast, True), ("torchkiln outside", fast, False),
                                ("eager under autocast", m, True)):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                    t = time.perf_counter()
                    call(f)
                    ts[name].append(time.perf_counter() - t)
    print("| call | median ms |\n|---|---|")
    for k, v in ts.items():
        print(f"| {k} | {statistics.median(v) * 1e3:.2f} |")

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2)).eval()
    fast = tk.llm.optimize(llm, dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (1, 16))
    print("| tk.llm generate, 16 new tokens | s |\n|---|---|")
    for i, (mode, on) in enumerate((("no_grad", False), ("inference_mode", False), ("inference_mode", True),
                                     ("inference_mode", True))):
        ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
        with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            t = time.perf_counter()
            fast.generate(ids, max_new_tokens=16, do_sample=False)
        print(f"| call {i + 1}, {mode}{', autocast' if on else ''} | {time.perf_counter() - t:.3f} |")


if __name__ == "__main__":
    main()
