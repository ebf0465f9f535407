"""Print tk.optimize's candidate table for the H200 cases (what was measured and why
that candidate serves). Usage: python benchmarks/report_gpu.py bert-base:1 bert-base:64"""

import sys

import torch

import torchkiln as tk
from torchkiln import inputs, zoo

for case in sys.argv[1:]:
    name, batch = case.split(":")
    model, sample = zoo.load(name, batch=int(batch))
    model = model.cuda()
    sample = inputs.to(inputs.normalize(sample), "cuda")
    o = tk.optimize(model, dtype=torch.bfloat16, sample_input=sample[1] or sample[0][0], time_budget=4.0)
    print(f"== {case}\n{o.kiln_report}\n", flush=True)
