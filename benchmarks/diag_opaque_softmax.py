"""Two changes to the int8 transformer path, each timed against the path without it, one process,
interleaved (bs1, bert-base seq128 by default):

- ``--part softmax``: the compiled attention's softmax as the opaque ``torchkiln::softmax_lastdim``
  (and the mask folded into baddbmm) against inductor's fused softmax kernel
  (passes/sdpa_math.py), for the int8 model; ``--dtypes bfloat16,float32`` is the control (their
  math form never takes the opaque softmax: FORMS; expect 1.00x and identical outputs);
- ``--part fused``: the int8 model's whole bf16 attention as the C++ op ``torchkiln::attention_bf16``
  (kernels/cpu_attention.cpp) against baddbmm + opaque softmax + bmm (SDPARouter.FUSED_ATTENTION);
- ``--part merge``: Q/K/V merged into one int8 linear before quantizing (quantization/
  concat_linear_fx.py) against three, whole model; ``--part qkv``: the GEMMs alone
  (``onednn::qlinear_pointwise``, 3 x 768 against one 2304-wide, 128 rows).

    python benchmarks/diag_opaque_softmax.py --part softmax,fused,merge,qkv
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

from torchkiln import ipex_peer
from torchkiln.passes.sdpa_math import SDPARouter
from torchkiln.quantization import pt2e_flow
from torchkiln.timing import interleaved
from torchkiln.zoo import load

warnings.filterwarnings("ignore")


def _report(title: str, times: dict[str, list[float]], base: str) -> None:
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"\n{title}")
    for n, m in med.items():
        print(f"  {n:<34} {1e3 * m:8.2f} ms   {med[base] / m:5.3f}x  ({len(times[n])} rounds)")


def _model_ab(model_name: str, dtype: str, variants: dict, budget: float) -> dict[str, list[float]]:
    """Build the model once per variant (``variants``: name -> a setup callable run before the build),
    check every variant gives the same output as the first, time them interleaved."""
    model, sample = load(model_name, batch=1)
    args, kwargs = ipex_peer._args_of(sample)
    fns, outs = {}, {}
    for name, setup in variants.items():
        undo = setup()
        try:
            fn = ipex_peer.build_torchkiln(model.eval(), sample, dtype)
            with torch.no_grad():
                for _ in range(3):
                    outs[name] = fn(*args, **kwargs)
        finally:
            undo()
        print(f"{name}: served {fn.kiln_report.active}", flush=True)
        fns[name] = fn
    ref = model(*args, **kwargs)
    first = next(iter(outs))
    for name, out in outs.items():
        o, r, f = (x[0] if isinstance(x, tuple) else getattr(x, "last_hidden_state", x)
                   for x in (out, ref, outs[first]))
        print(f"  {name}: max |out - float32 model| {(o - r).abs().max().item():.4f}, "
              f"|out - {first}| {(o - f).abs().max().item():.4f}")
    with torch.no_grad():
        return interleaved({n: (lambda f=f: f(*args, **kwargs)) for n, f in fns.items()},
                           torch.device("cpu"), budget, min_rounds=30, prune=10.0)


def _router(attr: str, value: bool):
    """A setup that sets SDPARouter's class switch ``attr`` (read at construction) and undoes it."""
    def setup():
        old = getattr(SDPARouter, attr)
        setattr(SDPARouter, attr, value)
        return lambda: setattr(SDPARouter, attr, old)
    return setup


def _flag(value: bool):
    return _router("OPAQUE_SOFTMAX", value)


def _fused(value: bool):
    return _router("FUSED_ATTENTION", value)


def _merge(value: bool):
    def setup():
        real = pt2e_flow.concat_sibling_linears
        if not value:
            pt2e_flow.concat_sibling_linears = lambda graph, keep=(): 0

        def undo():
            pt2e_flow.concat_sibling_linears = real
        return undo
    return setup


def qkv(budget: float) -> None:
    M, K = 128, 768
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g)
    sx, zp = float(x.abs().max() / 127), 128
    xq = torch.clamp(torch.round(x / sx) + zp, 0, 255).to(torch.uint8)

    def packed(n):
        w = torch.randn(n, K, generator=g) * 0.05
        ws = (w.abs().amax(1) / 127).float()
        wq = torch.round(w / ws[:, None]).clamp(-128, 127).to(torch.int8)
        return torch.ops.onednn.qlinear_prepack(wq, [M, K]), ws, torch.randn(n, generator=g), torch.zeros(n, dtype=torch.long)

    def call(p):
        return torch.ops.onednn.qlinear_pointwise(xq, sx, zp, p[0], p[1], p[3], p[2], 1.0, 0, torch.float32,
                                                  "none", [], "")
    three, one = [packed(768) for _ in range(3)], packed(2304)
    times = interleaved({"3 x (128x768 @ 768x768)": lambda: [call(p) for p in three],
                         "1 x (128x768 @ 768x2304)": lambda: call(one)}, torch.device("cpu"), budget,
                        min_rounds=200, prune=10.0)
    _report("Q/K/V int8 GEMMs (onednn::qlinear_pointwise, float32 out)", times, "3 x (128x768 @ 768x768)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="softmax,fused,merge,qkv")
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--dtypes", default="int8", help="for --part softmax: int8,bfloat16,float32")
    ap.add_argument("--budget", type=float, default=20.0)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    parts = a.part.split(",")
    if "softmax" in parts:
        for dtype in a.dtypes.split(","):
            t = _model_ab(a.model, dtype, {"opaque softmax": _flag(True), "inductor softmax": _flag(False)}, a.budget)
            _report(f"{a.model} {dtype} bs1: attention softmax", t, "inductor softmax")
    if "fused" in parts:
        t = _model_ab(a.model, "int8", {"fused attention op": _fused(True), "baddbmm+softmax+bmm": _fused(False)},
                      a.budget)
        _report(f"{a.model} int8 bs1: attention", t, "baddbmm+softmax+bmm")
    if "merge" in parts:
        t = _model_ab(a.model, "int8", {"Q/K/V merged": _merge(True), "Q/K/V apart": _merge(False)}, a.budget)
        _report(f"{a.model} int8 bs1: sibling linears", t, "Q/K/V apart")
    if "qkv" in parts:
        qkv(a.budget / 4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
