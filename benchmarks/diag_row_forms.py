"""The CPU decode's one-row forms alone and after an RMSNorm, compiled (what llm/model.row_forms times).

    python benchmarks/diag_row_forms.py

Inductor fuses a norm into RowLinear's reduction and then recomputes it per weight row; this shows
the cost next to F.linear and torchkiln's CPU GEMV. Shapes: llama-350m's bf16 gate/up and
llama-125m's float32 gate/up; weights cycled from DRAM; medians of 7 interleaved rounds, us.
"""

import torch
import torch.nn.functional as F

from torchkiln.kernels import cpu_gemv
from torchkiln.llm.model import _row_product, time_forms


def norm(x, g):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * g


def main() -> int:
    why = cpu_gemv.load()
    for dt, (n, k) in ((torch.bfloat16, (5632, 1024)), (torch.float32, (4096, 768))):
        ws = [torch.randn(n, k, dtype=dt) for _ in range(max(2, (192 << 20) // (n * k * dt.itemsize)))]
        g, x = torch.rand(k, dtype=dt), torch.randn(1, 1, k, dtype=dt)
        forms = {"F.linear": lambda x, g, w: F.linear(x, w),
                 "reduction": lambda x, g, w: _row_product(x, w, None),
                 "F.linear+norm": lambda x, g, w: F.linear(norm(x, g), w),
                 "reduction+norm": lambda x, g, w: _row_product(norm(x, g), w, None)}
        if why is None:
            forms["kernel"] = lambda x, g, w: cpu_gemv.gemv(x, w)
            forms["kernel+norm"] = lambda x, g, w: cpu_gemv.gemv(norm(x, g), w)
        t = time_forms(forms, [(x, g, w) for w in ws], rounds=7)
        print(dt, f"{n}x{k}", {a: round(b) for a, b in t.items()}, "" if why is None else f"(kernel: {why})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
