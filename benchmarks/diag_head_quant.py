"""What quantizing an output head to int8 or int4 does to its logits, on real weights: a proxy for
tk.llm's head choice (llm/quant.py INT4_HEAD), since no causal LM's weights ship offline here.

The head is all-MiniLM-L6-v2's word-embedding matrix (30522 x 384, real; BERT ties its MLM decoder
to it), the inputs its last hidden states over 240 real English sentences (tests/quantization's set),
quantized by torchkiln's own layers (the grids the CUDA kernels use: int8 per output channel, int4
asymmetric groups). Per form: how often the top-1 token agrees with the float head's, the float
head's top-1 among the form's top 5, the logits' cosine, and the KL divergence of the softmax.

    python benchmarks/diag_head_quant.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from quantization import minilm  # noqa: E402

from torchkiln.quantization.weight_only import Int4Linear, Int8Linear  # noqa: E402


def hidden_states(n: int) -> torch.Tensor:
    model, tok = minilm.load()
    rows = []
    with torch.no_grad():
        for b in minilm.batches(tok, minilm.sentences(n)):
            h = model(**b).last_hidden_state
            rows.append(h[b["attention_mask"].bool()])
    return torch.cat(rows), model.get_input_embeddings().weight.detach()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentences", type=int, default=240)
    a = ap.parse_args()
    h, emb = hidden_states(a.sentences)
    head = nn.Linear(emb.shape[1], emb.shape[0], bias=False)
    head.weight.data.copy_(emb)
    with torch.no_grad():
        ref = head(h)
        bf16 = nn.Linear(emb.shape[1], emb.shape[0], bias=False, dtype=torch.bfloat16)
        bf16.weight.data.copy_(emb)
        # bf16: the float head as tk.llm serves a bf16 model (weights and inputs rounded), for scale
        forms = {"bf16 (not quantized)": lambda x: bf16(x.to(torch.bfloat16)).float(),
                 "int8 per channel": Int8Linear(head), "int4 groups of 128": Int4Linear(head, 128),
                 "int4 groups of 64": Int4Linear(head, 64), "int4 groups of 32": Int4Linear(head, 32)}
        top = ref.argmax(-1)
        two = ref.topk(2, dim=-1).values
        gap = ((two[:, 0] - two[:, 1]) / ref.std(dim=-1)).median()
        print(f"{h.shape[0]} token positions, head {tuple(emb.shape)}; median top-1 margin {float(gap):.3f} logit stds")
        print("| head | top-1 agrees | float top-1 in top 5 | logits cosine | KL(float || form) |")
        print("|---|---|---|---|---|")
        for name, q in forms.items():
            got = q(h)
            agree = float((got.argmax(-1) == top).float().mean())
            in5 = float((got.topk(5, dim=-1).indices == top[:, None]).any(-1).float().mean())
            cos = float(F.cosine_similarity(got, ref, dim=-1).mean())
            kl = float(F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"))
            print(f"| {name} | {agree:.4f} | {in5:.4f} | {cos:.5f} | {kl:.5f} |")


if __name__ == "__main__":
    main()
