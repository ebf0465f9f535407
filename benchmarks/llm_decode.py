"""LLM decode speed: tk.llm against transformers' generate (eager, static cache) in one process.

    python benchmarks/llm_decode.py --config llama-125m --dtype float32             # CPU, the 3x target
    python benchmarks/llm_decode.py --config llama-3-8b --device cuda --dtype bfloat16 --quant int8,int4

Same as `torchkiln bench llm ...`; prints the table (median of interleaved rounds) and, with
--results, appends it to benchmarks/RESULTS.md with the command.
"""

import argparse
import sys
from datetime import date

import torch

from torchkiln.llm import bench


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-125m", choices=sorted(bench.CONFIGS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default="", help="weight-only schemes besides the dense model: int8,int4 (none: dense only)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peers", default="hf-eager,hf-static,torchkiln")
    ap.add_argument("--lookup", type=int, default=0, help="also time prompt-lookup speculation (K drafted tokens)")
    ap.add_argument("--results", help="append the table to this markdown file")
    a = ap.parse_args()
    quant = tuple(q for q in a.quant.split(",") if q and q != "none")  # the dense peer always runs
    rows, info = bench.run(a.config, a.device, getattr(torch, a.dtype), quant, a.batch, a.prompt, a.new_tokens,
                           a.rounds, tuple(a.peers.split(",")), lookup=a.lookup)
    text = bench.table(rows, info)
    print(text)
    for peer, rep in info["reports"].items():
        print(f"{peer}: compile s {rep['compile_s']}, setup s {rep['setup_s']}, verify error {rep['verify_error']}, "
              f"quant cosine {rep['quant_cosine']}, fallbacks {rep['fallbacks']}"
              + (f", CPU decode projections: {rep['cpu_gemv']}" if rep.get("cpu_gemv") else "")
              + (f", CUDA decode projections: {rep['cuda_gemv']}" if rep.get("cuda_gemv") else ""))
    if a.results:
        with open(a.results, "a") as f:
            f.write(f"\n### {date.today()} `python benchmarks/llm_decode.py {' '.join(sys.argv[1:])}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
