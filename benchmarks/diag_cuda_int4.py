"""torchkiln's CUDA C++ int4 kernel (kernels/cuda_int4.cu, on the tensor cores) against tinygemm, the
Triton word kernel and bf16 cuBLAS, one row, at Llama-3-8B's shapes; each peer inside one CUDA graph over
>= 256 MB of weight copies (llm_gemv.py's harness), medians of interleaved rounds. Every launch
shape the op offers is timed, so the table also picks the op's per-shape default. Then (``--wide``)
16 and 32 rows in one launch against the same rows 8 a launch (the forty-first session's form) and the
dequantized weight through cuBLAS, and the folded forms (norm prologue, gated epilogue, residual)
against the plain product plus the separate kernels they replace. Run on the GPU:

    python benchmarks/diag_cuda_int4.py [--rounds 5] [--configs 0,1,...] [--wide]

Before timing, each peer's output is checked against the weights dequantized in float32 (relative
error; a peer past 1e-2 is reported and left out), and the op is checked at groups 32/64/256 and
at 3 and 8 rows.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from llm_gemv import SHAPES, graph_of, interleaved

from torchkiln.kernels import cuda_int4
from torchkiln.quantization import gemv
from torchkiln.quantization.weight_only import Int4Linear


def codes(q4: Int4Linear) -> torch.Tensor:
    n, k = q4.packed.shape[0], 2 * q4.packed.shape[1]
    grp = q4.packed.view(n, k // q4.group, q4.group // 2)
    return torch.cat((grp & 0xF, grp >> 4), dim=-1).view(n, k)


def dequant(q4: Int4Linear) -> torch.Tensor:
    n, k = q4.packed.shape[0], 2 * q4.packed.shape[1]
    q = codes(q4).float().view(n, k // q4.group, q4.group)
    return (q * q4.scale.float()[..., None] + q4.zero.float()[..., None]).view(n, k)


def check_forms(dev) -> None:
    """Groups and row counts the shape sweep does not cover, against the float32 dequantized product."""
    for group in cuda_int4.GROUPS:
        for n, k in ((144, 512), (4096, 14336), (16, 256)):
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            q4 = Int4Linear(lin, group)
            packed = cuda_int4.pack(codes(q4))
            sz = cuda_int4.pack_scales(q4.scale, q4.zero)
            for rows in (1, 3, 8):
                x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                want = x.float() @ dequant(q4).T
                for cfg in range(-1, cuda_int4.CONFIGS):
                    got = cuda_int4.mm(x, packed, sz, group, cfg).float()
                    err = float((got - want).norm() / want.norm())
                    flag = "" if err < 4e-3 else "  <-- FAIL"
                    if flag or cfg == -1:
                        print(f"  check group {group} {n}x{k} rows {rows} config {cfg}: rel err {err:.2e}{flag}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default=",".join(str(c) for c in range(cuda_int4.CONFIGS)))
    ap.add_argument("--wide", action="store_true", help="only the wide-row and folded tables")
    args = ap.parse_args()
    dev = torch.device("cuda")
    why = next(filter(None, (cuda_int4.load(group=g) for g in cuda_int4.GROUPS)), None)
    if why:
        print("cuda_int4 not available:", why)
        return 1
    if args.wide:
        return wide_and_folded(dev, args.rounds)
    check_forms(dev)
    configs = [int(c) for c in args.configs.split(",")]
    print("| shape | peer | us/call | x bf16 | x tinygemm | weight GB/s |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        q4 = Int4Linear(lin, 128)
        count = max(2, -(-(256 << 20) // (n * k)))
        p4 = [q4.packed.clone() for _ in range(count)]
        mma = [cuda_int4.pack(codes(q4)) for _ in range(count)]
        sz4 = cuda_int4.pack_scales(q4.scale, q4.zero)
        tg = [Int4Linear(lin, 128, tinygemm=True) for _ in range(count)]
        b4 = n * k // 2 + 4 * n * (k // 128)
        peers = {
            "bf16 F.linear": (F.linear, [(x, lin.weight.detach().clone()) for _ in range(count)], 2 * n * k),
            "int4 tinygemm": (lambda x, m: m(x), [(x, m) for m in tg], b4),
            "int4 Triton words (served for Int4Linear's layout)":
                (lambda x, p, s, z: gemv.int4_linear(x, p, s, z, 128), [(x, p, q4.scale, q4.zero) for p in p4], b4),
        }
        for c in configs:
            peers[f"int4 CUDA config {c}"] = (
                lambda x, p, sz, c=c: cuda_int4.mm(x, p, sz, 128, c), [(x, p, sz4.clone()) for p in mma], b4)
        w4f = dequant(q4)
        graphs = {}
        for p, (fn, a, _) in peers.items():
            got = fn(*a[0]).float()
            want = x.float() @ (lin.weight.detach().float() if p.startswith("bf16") else w4f).T
            err = float((got - want).norm() / want.norm())
            if err > 1e-2:
                print(f"  {name} {p}: relative error {err:.4f} against its reference; left out")
                continue
            graphs[p] = graph_of(fn, a)
        times = interleaved(graphs, args.rounds, count)
        base = times["bf16 F.linear"]
        tiny = times["int4 tinygemm"]
        for p, s in times.items():
            print(f"| {name} {n}x{k} | {p} | {s * 1e6:.1f} | {base / s:.2f} | {tiny / s:.2f} | "
                  f"{peers[p][2] / s / 1e9:.0f} |", flush=True)
        del peers, graphs, p4, tg, mma
        torch.cuda.empty_cache()
    return 0


def wide_and_folded(dev, rounds: int) -> int:
    """Prefill widths in one launch vs 8 rows a launch vs cuBLAS on the dequantized weight; then the
    folded one-row forms vs the plain product with the separate kernels the decode step ran before."""
    print("| shape | rows | one launch us | 8 a launch us | dequantize + cuBLAS us | x 8 a launch |")
    print("|---|---|---|---|---|---|")
    for name in ("qkv", "gate_up", "down"):
        for rows in (16, 32):
            _wide(name, rows, dev, rounds)
    print()
    print("| shape | folded form | folded us | plain + separate kernels us | x |")
    print("|---|---|---|---|---|")
    for name, fold in (("qkv", "norm"), ("gate_up", "gated"), ("o", "resid"), ("down", "resid")):
        _folded(name, fold, dev, rounds)
    return 0


def _layer(name, dev):
    n, k = SHAPES[name]
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    q4 = Int4Linear(lin, 128, mma=True)
    count = max(2, -(-(256 << 20) // (n * k // 2)))
    return n, k, q4, count, [q4.packed.clone() for _ in range(count)]


def _wide(name, rows, dev, rounds):
    n, k, q4, count, mma = _layer(name, dev)
    op, cfg, sz = cuda_int4.op(128), q4.config, q4.scale_zero
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    want = x.float() @ q4._dense(cuda_int4.unpack(q4.packed), torch.float32, *cuda_int4.unpack_scales(sz)).T
    forms = {"one": lambda p: op(x, p, sz, cfg),
             "eights": lambda p: torch.cat([op(x[i:i + 8], p, sz, cfg) for i in range(0, rows, 8)]),
             "cublas": lambda p: F.linear(x, q4._dense(cuda_int4.unpack(p), x.dtype, *cuda_int4.unpack_scales(sz)))}
    for f, fn in forms.items():
        err = float((fn(mma[0]).float() - want).norm() / want.norm())
        assert err < 4e-3, (name, rows, f, err)
    graphs = {f: graph_of(fn, [(p,) for p in mma[:4 if f == "cublas" else count]]) for f, fn in forms.items()}
    t = interleaved(graphs, rounds, {"one": count, "eights": count, "cublas": 4})
    print(f"| {name} {n}x{k} | {rows} | {t['one'] * 1e6:.1f} | {t['eights'] * 1e6:.1f} | "
          f"{t['cublas'] * 1e6:.1f} | {t['eights'] / t['one']:.2f} |", flush=True)


def _folded(name, fold, dev, rounds, eps=1e-5):
    n, k, q4, count, mma = _layer(name, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    g = torch.rand(k, device=dev) + 0.5
    out_n = n // 2 if fold == "gated" else n
    r = torch.randn(1, out_n, device=dev, dtype=torch.bfloat16)
    sz, op, cfg = q4.scale_zero, cuda_int4.op(128), q4.config
    fcfg = cuda_int4.tune(n, k, 128, dev, None if fold == "resid" else fold)

    def norm(x):  # as the unfolded step computes it (transformers' RMSNorm, in float32)
        return ((x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)) * g).to(x.dtype)

    def gate(h):
        return F.silu(h[:, :out_n]) * h[:, out_n:]

    forms = {"resid": (lambda p: op(x, p, sz, cfg, None, 0.0, False, None, r), lambda p: op(x, p, sz, cfg) + r),
             "norm": (lambda p: op(x, p, sz, fcfg, g, eps), lambda p: op(norm(x), p, sz, cfg)),
             "gated": (lambda p: op(x, p, sz, fcfg, g, eps, True), lambda p: gate(op(norm(x), p, sz, cfg)))}
    folded, plain = forms[fold]
    a, b = folded(mma[0]).float(), plain(mma[0]).float()
    err = float((a - b).norm() / b.norm())
    assert err < 2e-2, (name, fold, err)
    graphs = {"folded": graph_of(folded, [(p,) for p in mma]), "plain": graph_of(plain, [(p,) for p in mma])}
    t = interleaved(graphs, rounds, count)
    print(f"| {name} {n}x{k} | {fold} (config {fcfg}) | {t['folded'] * 1e6:.1f} | {t['plain'] * 1e6:.1f} | "
          f"{t['plain'] / t['folded']:.2f} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
