"""Where the time goes on GPU: top CUDA kernels for torchkiln and the torch.compile bf16 peer.

    python benchmarks/profile_gpu.py resnet50 256
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import torchkiln as tk
from torchkiln import inputs, zoo
from torchkiln.passes import compile_model

name, batch = sys.argv[1], int(sys.argv[2])
model, x = zoo.load(name, batch=batch)
model = model.cuda().eval()
args, kwargs = inputs.to(inputs.normalize(x), "cuda")
kiln = tk.optimize(model, dtype=torch.bfloat16, sample_input=(args if args else kwargs))
import copy  # noqa: E402

peer_model = compile_model(copy.deepcopy(model).to(torch.bfloat16), {})
pa, pk = inputs.to((args, kwargs), dtype=torch.bfloat16)
for label, fn, a, k in (("torchkiln", kiln, args, kwargs), ("compile bf16-cast", peer_model, pa, pk)):
    with torch.no_grad():
        for _ in range(5):
            fn(*a, **k)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                fn(*a, **k)
            torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages()) / 10 / 1e3
    print(f"\n== {name} bs{batch} {label}: GPU kernel time {total:.2f} ms/call")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70))
