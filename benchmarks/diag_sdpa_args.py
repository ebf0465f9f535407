"""What torchkiln's opaque attention op receives inside a compiled HF model, which
SDPA backends accept it (torch's own debug reasons), and what each mask form costs.

    python benchmarks/diag_sdpa_args.py --device cuda --batch 64
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import torchkiln as tk
import torchkiln.passes.sdpa_math as sm
from torchkiln import inputs, zoo
from torchkiln.candidates import KilnBuild
from torchkiln.passes.compile import compile_model
from torchkiln.plan import plan
from torchkiln.timing import median_seconds


def describe(t):
    return None if t is None else (str(t.dtype), tuple(t.shape), t.stride(), t.is_contiguous())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    model, x = zoo.load("bert-base", batch=a.batch)
    model = model.to(a.device).eval()
    args, kwargs = inputs.to(inputs.normalize(x), a.device)
    seen = []
    real = sm._aten_sdpa

    def spy(q, k, v, m, c, s, g):
        if not seen and not isinstance(q, torch._subclasses.FakeTensor):
            seen.append((q.clone(), k.clone(), v.clone(), None if m is None else m.clone(), m))
        return real(q, k, v, m, c, s, g)

    sm._aten_sdpa = spy
    for label, kw in (("mask dropped", {**kwargs, "attention_mask": None}), ("all-ones mask kept", kwargs)):
        seen.clear()
        rec = plan(model, tk.detect(), a.device, torch.bfloat16, "O1", {}, batch=a.batch)
        rec = rec.replace(drop_all_ones_mask=False)
        build = KilnBuild(model, rec, (args, kw), False, [])
        fn = build.call(compile_model(build.runner(), dict(rec.compile_options) | {"triton.cudagraphs": False},
                                      private=True), False)
        with torch.no_grad():
            fn(*args, **kw)
        q, k, v, m, m_orig = seen[0]
        print(f"\n== {label}: q {describe(q)}, k {describe(k)}\n   mask as received {describe(m_orig)}")
        if a.device == "cuda":
            p = torch.backends.cuda.SDPAParams(q, k, v, m_orig, 0.0, False, False)
            for kind in ("flash", "efficient", "cudnn"):
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    ok = getattr(torch.backends.cuda, f"can_use_{kind}_attention")(p, True)
                print(f"   can_use_{kind}: {ok}", "; ".join(str(x.message)[:200] for x in w))
        forms = {"as received": m_orig, "None": None}
        if m is not None:
            forms["contiguous"] = m.contiguous()
            add = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(~m, float("-inf")) \
                if m.dtype == torch.bool else m.to(q.dtype)
            forms["additive, q dtype"] = add
            forms["additive, expanded to heads"] = add.expand(-1, q.size(1), -1, -1).contiguous()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
        for name, mask in forms.items():
            with torch.no_grad():
                t = median_seconds(lambda mask=mask, q=q, k=k, v=v: (sm.sdpa(q, k, v, mask, False, None, False),
                                                      torch.cuda.synchronize() if a.device == "cuda" else None))
                with profile(activities=acts) as prof:
                    sm.sdpa(q, k, v, mask, False, None, False)
            kern = [e.key for e in prof.key_averages() if "attention" in e.key or "sdpa" in e.key.lower()
                    or "bmm" in e.key]
            print(f"   mask {name:28s} {1e6 * t:8.1f} us  {kern[:3]}")


if __name__ == "__main__":
    main()
