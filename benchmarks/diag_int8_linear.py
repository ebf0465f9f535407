"""The int8 linears of a pt2e transformer as ``torchkiln::qlinear_u8`` (passes/int8_linear.py) against
inductor's ``onednn::qlinear_pointwise``: per call at bert-base's shapes (``--part op``), and the whole
served model built both ways, one process, interleaved (``--part model``, bs1 seq128 by default).

    python benchmarks/diag_int8_linear.py --part op,model
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.nn.functional as F

from torchkiln.kernels import cpu_qlinear
from torchkiln.quantization import plan as qplan
from torchkiln.timing import interleaved

warnings.filterwarnings("ignore")


def _report(title: str, times: dict[str, list[float]], base: str, unit: float = 1e3, name: str = "ms") -> None:
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"\n{title}")
    for n, m in med.items():
        print(f"  {n:<34} {unit * m:9.2f} {name}   {med[base] / m:5.3f}x  ({len(times[n])} rounds)")


def op(budget: float) -> None:
    g = torch.Generator().manual_seed(0)
    for K, N, gelu in ((768, 2304, False), (768, 768, False), (768, 3072, True), (3072, 768, False)):
        _one_shape(g, K, N, gelu, budget)


def _one_shape(g, K: int, N: int, gelu: bool, budget: float) -> None:
    M, sx, zx, so, zo = 128, 0.03, 130, 0.01, 20
    x = torch.randint(0, 256, (M, K), generator=g, dtype=torch.uint8)
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    ws, b = torch.rand(N, generator=g) * 0.002 + 5e-4, torch.randn(N, generator=g)
    packed, zps = torch.ops.onednn.qlinear_prepack(w, [M, K]), torch.zeros(N, dtype=torch.long)
    # inductor's op with uint8 out and GELU, as its lowering of linear -> gelu -> quantize calls it
    out = (so, zo, torch.uint8, "gelu", [], "none") if gelu else (1.0, 0, torch.float32, "none", [], "")

    def inductor():
        return torch.ops.onednn.qlinear_pointwise(x, sx, zx, packed, ws, zps, b, *out)

    def ours():
        return cpu_qlinear.qlinear(x, sx, zx, w, ws, b, *(("gelu_erf", so, zo) if gelu else ()))
    if gelu:
        d = (ours().int() - inductor().int()).abs()
        check = f"codes differing from inductor's op: {float((d > 0).float().mean()):.1e} (max {int(d.max())})"
    else:
        ref = F.linear((x.float() - zx) * sx, w.float() * ws[:, None], b)
        check = f"relative error vs float32 math on the same codes: {float((ours() - ref).norm() / ref.norm()):.1e}"
    with torch.no_grad():
        t = interleaved({"onednn::qlinear_pointwise": inductor, "torchkiln::qlinear_u8": ours},
                        torch.device("cpu"), budget, min_rounds=100, prune=10.0)
    _report(f"{M}x{K} @ {K}x{N}{' + gelu, uint8 out' if gelu else ''} ({check})", t,
            "onednn::qlinear_pointwise", 1e6, "us")


def _flag(value: bool):
    def setup():
        old = qplan.INT8_LINEAR
        qplan.INT8_LINEAR = value
        return lambda: setattr(qplan, "INT8_LINEAR", old)
    return setup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="op,model")
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--budget", type=float, default=20.0)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; qlinear_u8: {cpu_qlinear.load() or 'built'}")
    parts = a.part.split(",")
    if "op" in parts:
        op(a.budget / 8)
    if "model" in parts:
        from diag_opaque_softmax import _model_ab  # one model-building A/B for the int8 diagnostics
        t = _model_ab(a.model, "int8", {"torchkiln::qlinear_u8": _flag(True), "inductor's qlinear": _flag(False)},
                      a.budget)
        _report(f"{a.model} int8 bs1: linears", t, "inductor's qlinear")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
