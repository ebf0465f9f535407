"""IPEX 2.8 as a benchmark peer: `torchkiln bench MODEL --peer ipex` and benchmarks/vs_ipex.py.

IPEX needs its own torch (2.8), so it runs in a separate venv (``bash benchmarks/ipex_env.sh``
makes one, ~7 GB; never a dependency of torchkiln). Each peer is one served process of this
file: it builds a zoo model the way that peer prescribes, warms it up, then answers ``run K``
lines on stdin with K timed calls. The driver alternates timed rounds between the peers' processes
(the others wait idle on a pipe) and pairs them per round: on a shared 2-core machine one
process-after-another run measured IPEX 65 ms and then 78 ms minutes apart, a drift larger than
the gaps being measured (benchmarks/RESULTS.md, "Interleaved").

The worker half imports only torch and torchkiln.zoo, so it runs under the IPEX venv's python
by file path; torchkiln itself is imported only in torchkiln's own environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

PEERS = ("compile", "ipex", "torchkiln")
DTYPES = ("float32", "bfloat16", "int8")
DEFAULT_VENV = os.path.join("~", ".cache", "torchkiln", "ipex-venv")


def default_python() -> str:
    """The IPEX venv's python: $TORCHKILN_IPEX_PYTHON, else the venv ipex_env.sh makes."""
    venv = os.environ.get("IPEX_VENV", os.path.expanduser(DEFAULT_VENV))
    return os.environ.get("TORCHKILN_IPEX_PYTHON", os.path.join(venv, "bin", "python"))


# ---- the worker: runs in the peer's own environment -------------------------------------

def _args_of(sample):
    return ((), sample) if isinstance(sample, dict) else ((sample,), {})


def build_ipex(model, sample, dtype):
    """As IPEX's documentation prescribes: ipex.optimize, then torch.jit.trace + freeze
    (under autocast for bf16); int8 through ipex.quantization prepare/convert (static)."""
    import intel_extension_for_pytorch as ipex
    import torch

    args, kwargs = _args_of(sample)
    # strict=False: a transformers model returns a ModelOutput (a dict), which a strict trace refuses;
    # IPEX's examples for transformers trace this way
    trace_kw = dict(example_kwarg_inputs=kwargs, strict=False) if kwargs else dict(strict=False)
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


def build_torchkiln(model, sample, dtype):
    import torch

    import torchkiln as tk

    if dtype == "int8":
        return tk.optimize(model, quantize="int8-static", calib_data=[sample] * 4, sample_input=sample)
    return tk.optimize(model, dtype=getattr(torch, dtype), sample_input=sample)


def build_compile(model, sample, dtype):
    """The stock recipe: torch.compile with freezing (under autocast for bf16); int8 is pt2e as
    torchao documents it: export, X86InductorQuantizer, calibrate, convert, then compile."""
    import torch

    # The global switch, as PyTorch's CPU inference docs set it: on torch 2.13
    # `torch.compile(options={"freezing": True})` leaves parameters unfrozen (passes/compile.py).
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    if dtype == "int8":  # strict export first, the order this peer was measured with (RESULTS.md)
        from torchkiln import stock

        args, kwargs = _args_of(sample)
        model = stock.pt2e_int8(model, args, kwargs, [(args, kwargs)] * 4, strict_order=(True, False),
                                say=lambda m: print(m, file=sys.stderr))
    fn = torch.compile(model)
    if dtype == "bfloat16":
        def run(*a, **k):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*a, **k)
        return run
    return fn


def _zoo():
    """torchkiln.zoo; in the IPEX venv (no torchkiln there) the same file, loaded by path: it
    needs only torch. Never by putting torchkiln's site-packages on the path, which would put
    its torch ahead of IPEX's."""
    try:
        from torchkiln import zoo
        return zoo
    except ImportError:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo.py")
        spec = importlib.util.spec_from_file_location("_torchkiln_zoo", path)
        zoo = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(zoo)
        return zoo


BUILDERS = {"ipex": build_ipex, "torchkiln": build_torchkiln, "compile": build_compile}


def serve(argv=None) -> None:
    """Build once, warm up, print a ready line, then answer `run K` with K timed calls as one
    JSON line, until `quit` or end of input."""
    import torch

    zoo = _zoo()
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True, choices=PEERS)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args(argv)
    model, sample = zoo.load(a.model, batch=a.batch, seq=a.seq)
    t0 = time.perf_counter()
    fn = BUILDERS[a.peer](model.eval(), sample, a.dtype)
    args, kwargs = _args_of(sample)
    with torch.no_grad():
        for _ in range(a.warmup):
            fn(*args, **kwargs)
    report = getattr(fn, "kiln_report", None) if a.peer == "torchkiln" else None
    served = str(getattr(report, "active", "")) if report is not None else ""
    # what optimize() measured when it chose (a choice that differs from a cell's times shows here)
    measured = {m.name: m.median_ms for m in getattr(report, "candidates", []) if m.median_ms is not None}
    print(json.dumps({"ready": True, "peer": a.peer, "setup_s": round(time.perf_counter() - t0, 1),
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "served": served,
                      "candidates_ms": measured, "applied": list(getattr(report, "applied", []))}), flush=True)
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


# ---- the driver: runs in torchkiln's environment -----------------------------------------

class Peer:
    """One peer's served worker process."""

    def __init__(self, name: str, python: str, model: str, dtype: str, batch: int, seq: int = 128):
        self.name, self.error, self.info = name, None, {}
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr to a file: a full pipe would block the worker
        cmd = [python, os.path.abspath(__file__), "--peer", name, "--model", model, "--dtype", dtype,
               "--batch", str(batch), "--seq", str(seq)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.info = self._reply() or {}

    def _reply(self):
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.log.seek(0)
        tail = (self.log.read().strip().splitlines() or ["no output"])[-1][:200]
        self.error = tail
        return None

    def run(self, iters: int):
        if self.error:
            return None
        self.proc.stdin.write(f"run {iters}\n")
        self.proc.stdin.flush()
        r = self._reply()
        return r["median_ms"] if r else None

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            self.proc.wait(timeout=60)
        self.log.close()


@dataclass
class Cell:
    """One model x batch x precision: per-peer median ms, torchkiln / IPEX from paired rounds."""

    model: str
    batch: int
    dtype: str
    median_ms: dict = field(default_factory=dict)  # peer -> ms (None: failed or not run)
    errors: dict = field(default_factory=dict)  # peer -> last line of its stderr
    ratio: float | None = None  # median over rounds of ipex_ms / torchkiln_ms (>1: torchkiln faster)
    ratio_range: tuple | None = None
    served: str = ""  # what torchkiln served
    candidates_ms: dict = field(default_factory=dict)  # what optimize() measured when it chose
    applied: list = field(default_factory=list)  # the served candidate's passes and notes (report.applied)

    def row(self) -> str:
        def ms(p):
            if self.median_ms.get(p):
                return f"{self.median_ms[p]:.1f}"
            return f"failed ({self.errors[p]})" if p in self.errors else "not run"

        r = f"{self.ratio:.2f}x [{self.ratio_range[0]:.2f}-{self.ratio_range[1]:.2f}]" if self.ratio else "-"
        return (f"| {self.model} | {self.batch} | {self.dtype} | {ms('compile')} | {ms('ipex')} | "
                f"{ms('torchkiln')} | {r} | {self.served} |")

    def to_dict(self) -> dict:
        return asdict(self)


HEADER = ("| model | batch | precision | torch.compile ms | IPEX 2.8 ms | torchkiln ms | torchkiln / IPEX "
          "(paired rounds: median [min-max]) | torchkiln served |\n|---|---|---|---|---|---|---|---|")


def compare(model: str, dtype: str = "float32", batch: int = 1, peers=PEERS, rounds: int = 10, iters: int = 8,
            ipex_python: str | None = None, seq: int = 128, tick=None) -> Cell:
    """Build each peer's process one at a time (compiles must not overlap), then time them
    interleaved: `rounds` rounds, each asking every peer for `iters` calls in turn, the order
    rotating per round."""
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"peers={list(peers)}: unknown peer(s) {bad}; choose from {list(PEERS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: the IPEX comparison runs one of {list(DTYPES)}")
    python = ipex_python or default_python()
    if "ipex" in peers and not os.path.exists(python):
        raise FileNotFoundError(f"no IPEX python at {python!r}: make the venv with `bash benchmarks/ipex_env.sh`, "
                                "or point --ipex-python (or $TORCHKILN_IPEX_PYTHON) at one")
    procs = []
    try:
        for name in peers:
            procs.append(Peer(name, python if name == "ipex" else sys.executable, model, dtype, batch, seq))
            if tick:
                tick()
        per_round = {p.name: [] for p in procs}
        for r in range(rounds):
            for p in procs[r % len(procs):] + procs[:r % len(procs)]:
                time.sleep(0.05)  # let the previous process's OpenMP threads stop spinning
                per_round[p.name].append(p.run(iters))
            if tick:
                tick()
    finally:
        for p in procs:
            p.close()
    cell = Cell(model, batch, dtype, errors={p.name: p.error for p in procs if p.error})
    for name, vs in per_round.items():
        ok = [v for v in vs if v is not None]
        cell.median_ms[name] = statistics.median(ok) if ok else None
    pairs = [i / t for i, t in zip(per_round.get("ipex", []), per_round.get("torchkiln", []), strict=False)
             if i and t]
    if pairs:
        cell.ratio, cell.ratio_range = statistics.median(pairs), (min(pairs), max(pairs))
    kiln = next((p.info for p in procs if p.name == "torchkiln"), {})
    cell.served, cell.candidates_ms = kiln.get("served", ""), kiln.get("candidates_ms", {})
    cell.applied = kiln.get("applied", [])
    return cell


if __name__ == "__main__":
    # Run by file path, python puts this package's directory first on sys.path, where its
    # modules (inputs, runner, ...) would shadow top-level ones: take it off.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    serve()
