"""fp8 on bert-base bf16 (CUDA): which activation-scale granularity, and which layers, make fp8
pay off. #8 measured tk.quantize's fp8 (torchao, per-row scales, every linear) at 0.37x torchkiln
bf16 on the H200 at bs64: the per-row activation scaling kernels cost more than the fp8 GEMMs save.

    python benchmarks/diag_fp8_granularity.py --batch 64 --rounds 5

Variants, each torchao ``quantize_`` on a copy of the bf16 model, then ``torch.compile``: per-row or
per-tensor scales, on every linear or on the FFN linears only (the two widest GEMMs of a layer).
Prints the relative L2 error against the bf16 model, wall ms per call (interleaved rounds, CUDA
synchronised, medians), and kernel ms per call with the top kernels of each fp8 variant."""

import copy
import warnings

import torch
from _variants import bert_bf16_cuda, build_bert, fp8_args, synced_ms
from quantization import top_kernels

warnings.filterwarnings("ignore")


def ffn_only(module, fqn):
    return isinstance(module, torch.nn.Linear) and (".intermediate." in fqn or fqn.endswith("output.dense")
                                                    and ".attention." not in fqn)


def main():
    a = fp8_args(__doc__)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
    from torchao.quantization.granularity import PerRow, PerTensor

    model, x = bert_bf16_cuda(a.batch)

    def fp8(gran, filter_fn=None):
        def build():
            q = copy.deepcopy(model)
            quantize_(q, Float8DynamicActivationFloat8WeightConfig(granularity=gran()), filter_fn=filter_fn)
            return torch.compile(q)
        return build

    builds = {"bf16 compile": lambda: torch.compile(model),
              "fp8 per-row, all": fp8(PerRow), "fp8 per-tensor, all": fp8(PerTensor),
              "fp8 per-row, FFN": fp8(PerRow, ffn_only), "fp8 per-tensor, FFN": fp8(PerTensor, ffn_only)}
    fns = build_bert(builds, model, x, "bf16 eager")
    with torch.no_grad():
        wall = synced_ms(fns, a.rounds, a.iters)
    base = wall["bf16 compile"]
    print(f"\nbert-base bs{a.batch} seq128 on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| variant | wall ms | x bf16 compile |\n|---|---|---|")
    for name in fns:
        print(f"| {name} | {wall[name]:.3f} | {base / wall[name]:.2f}x |")
    for name, f in fns.items():
        top_kernels(name, f, top=6)


if __name__ == "__main__":
    main()
