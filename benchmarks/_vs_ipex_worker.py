"""One configuration, one process: build a zoo model, prepare it the way a peer prescribes, time
it, print one JSON line. Runs in the IPEX venv (--peer ipex) or torchkiln's own environment
(--peer torchkiln / compile). Driven by benchmarks/vs_ipex.py."""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from torchkiln import zoo  # noqa: E402  (zoo needs only torch; it imports in the IPEX venv too)


def args_of(sample):
    return ((), sample) if isinstance(sample, dict) else ((sample,), {})


def calib(sample, n=4):
    return [sample for _ in range(n)]


def ipex_model(model, sample, dtype):
    """As IPEX's documentation prescribes: ipex.optimize, then torch.jit.trace + freeze
    (under autocast for bf16); int8 through ipex.quantization prepare/convert (static)."""
    import intel_extension_for_pytorch as ipex

    args, kwargs = args_of(sample)
    trace_kw = dict(example_kwarg_inputs=kwargs, strict=False) if kwargs else {}
    with torch.no_grad():
        if dtype == "int8":
            from intel_extension_for_pytorch.quantization import convert, prepare

            qconfig = ipex.quantization.default_static_qconfig_mapping
            prepared = prepare(model, qconfig, example_inputs=args or None, example_kwarg_inputs=kwargs or None,
                               inplace=False)
            for _ in range(4):
                prepared(*args, **kwargs)
            model = convert(prepared)
            traced = torch.jit.trace(model, args if args else None, check_trace=False, **trace_kw)
            return torch.jit.freeze(traced)
        if dtype == "bfloat16":
            model = ipex.optimize(model, dtype=torch.bfloat16)
            with torch.cpu.amp.autocast():
                traced = torch.jit.trace(model, args if args else None, check_trace=False, **trace_kw)
            return torch.jit.freeze(traced)
        model = ipex.optimize(model)
        traced = torch.jit.trace(model, args if args else None, check_trace=False, **trace_kw)
        return torch.jit.freeze(traced)


def torchkiln_model(model, sample, dtype):
    import torchkiln as tk

    if dtype == "int8":
        return tk.optimize(model, quantize="int8-static", calib_data=calib(sample), sample_input=sample)
    return tk.optimize(model, dtype=getattr(torch, dtype), sample_input=sample)


def compile_model(model, sample, dtype):
    """The stock recipe: torch.compile with freezing (under autocast for bf16); int8 is pt2e as
    torchao documents it: export, X86InductorQuantizer, calibrate, convert, then compile."""
    # The global switch, as PyTorch's CPU inference docs set it: on torch 2.13
    # `torch.compile(options={"freezing": True})` leaves parameters unfrozen (passes/compile.py).
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    if dtype == "int8":
        model = stock_pt2e_int8(model, sample)
    fn = torch.compile(model)
    if dtype == "bfloat16":
        def run(*a, **k):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*a, **k)
        return run
    return fn


def stock_pt2e_int8(model, sample):
    """Strict export first: non-strict export (torch 2.13's default) leaves the shared ReLU of a
    ResNet bottleneck as one partition, which X86InductorQuantizer refuses; a skilled user who
    hits that error switches to strict. Non-strict when strict export cannot trace the model."""
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    args, kwargs = args_of(sample)
    try:
        graph = torch.export.export(model, args, kwargs, strict=True).module()
    except Exception:
        graph = torch.export.export(model, args, kwargs, strict=False).module()
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for _ in range(4):
            prepared(*args, **kwargs)
    converted = convert_pt2e(prepared)
    try:
        from torchao.quantization.pt2e import move_exported_model_to_eval
    except ImportError:  # older torchao: the torch.ao one
        from torch.ao.quantization import move_exported_model_to_eval
    move_exported_model_to_eval(converted)
    return converted


def main():
    """Build once, warm up, print a ready line, then serve `run K` requests from the driver: K
    timed calls each, printed as one JSON line. The driver alternates these requests between
    peers' processes, so every peer is timed in the same stretch of wall-clock time (this shared
    2-core machine drifts by up to 30% over seconds, far more than the gaps being measured)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True, choices=["ipex", "torchkiln", "compile"])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    model, sample = zoo.load(a.model, batch=a.batch)
    t0 = time.perf_counter()
    build = {"ipex": ipex_model, "torchkiln": torchkiln_model, "compile": compile_model}[a.peer]
    fn = build(model.eval(), sample, a.dtype)
    args, kwargs = args_of(sample)
    with torch.no_grad():
        for _ in range(a.warmup):
            fn(*args, **kwargs)
    served = str(getattr(getattr(fn, "kiln_report", None), "active", "")) if a.peer == "torchkiln" else ""
    print(json.dumps({"ready": True, "peer": a.peer, "setup_s": round(time.perf_counter() - t0, 1),
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "served": served}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "run":
            break
        times = []
        with torch.no_grad():
            for _ in range(int(cmd[1])):
                t = time.perf_counter()
                fn(*args, **kwargs)
                times.append((time.perf_counter() - t) * 1e3)
        print(json.dumps({"times_ms": times, "median_ms": statistics.median(times)}), flush=True)


if __name__ == "__main__":
    main()
