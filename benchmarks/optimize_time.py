"""Wall time of tk.optimize() (plan + passes + compile + verify) for one zoo model.

Run it twice: the second process reuses inductor's on-disk caches (FX graph and
autotuning results), which is how torchkiln reuses compiled artefacts across
processes.  python benchmarks/optimize_time.py resnet50 256 bfloat16 cuda O1
"""

import json
import sys
import time

import torch

import torchkiln as tk
from torchkiln import zoo

name, batch, dtype, device, level = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
model, x = zoo.load(name, batch=batch)
model = model.to(device)
x = {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)
t = time.perf_counter()
o = tk.optimize(model, dtype=dtype, level=level, sample_input=x)
wall = time.perf_counter() - t
print(json.dumps({"model": name, "batch": batch, "dtype": dtype, "device": device, "level": level,
                  "optimize_s": round(wall, 1), "active": o.kiln_report.active,
                  "rel_err": o.kiln_report.error["rel"], "torch": torch.__version__}))
