"""tk.bench(): torchkiln side by side with the stock-PyTorch peers a skilled user
would try, timed the same way in the same process, with error against fp32 eager.

Peers are the recipes of ``torchkiln.stock`` (the same ones optimize() weighs):
eager fp32 (the speedup baseline); plain torch.compile; the fp32 compile recipes
and, where a low dtype is asked, eager and compiled bf16/fp16 by cast and by
autocast. On CUDA that includes CUDA graphs (``reduce-overhead``) and, when asked,
``max-autotune-no-cudagraphs``. Each peer runs on its own copy of the model with its
own dynamo cache (passes.compile.Fresh), so peers can't share state or graphs.
torchkiln is compared with the fastest peer at the dtype it actually served.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import _log, inputs, stock
from ._log import quiet_deprecations
from .guard import compare
from .modelutil import keeps_mode, parse_dtype
from .modelutil import model_device as _model_device
from .optimize import optimize
from .progress import progress as progress_bar


@dataclass
class Row:
    name: str
    median_ms: float
    p90_ms: float
    p99_ms: float
    throughput: float  # items (batch rows) per second
    # What the peer itself added over build + first call + warm-up: its weight casts,
    # packed weights, compiled code and buffers, activations; not the model copy
    # bench hands it, made before the baseline. GPU: peak allocated minus allocated
    # right after that copy. CPU: resident memory (RSS) growth, which also counts
    # allocator caching and the compiler's own memory.
    peak_mem_mb: float | None
    setup_s: float  # build + first call (compilation)
    rel_err: float  # vs fp32 eager
    dtype: str  # compute dtype: a peer's recipe dtype; for torchkiln, the one it served
    speedup: float = 1.0  # vs eager fp32
    gflops: float | None = None
    peak_frac: float | None = None  # of the measured GEMM peak
    note: str = ""


@dataclass
class BenchResult:
    model: str
    device: str
    dtype: str
    batch: int | None
    rows: list[Row] = field(default_factory=list)
    flops: float | None = None  # per call
    gemm_peak_gflops: float | None = None

    def best_kiln(self) -> Row | None:
        kiln = [r for r in self.rows if r.name.startswith("torchkiln")]
        return min(kiln, key=lambda r: r.median_ms) if kiln else None

    def best_peer(self) -> Row | None:
        """The fastest peer at the dtype torchkiln served: if it fell back to fp32, beating a
        bf16 peer would be a precision trade, not an optimization. Plain eager counts when it
        runs that dtype (a float32 request): beating only a slower compile recipe is no win."""
        kiln = self.best_kiln()
        dtype = kiln.dtype if kiln else self.dtype
        pool = [r for r in self.rows if not r.name.startswith("torchkiln") and r.dtype == dtype]
        return min(pool, key=lambda r: r.median_ms) if pool else None

    def vs_best_peer(self) -> float | None:
        kiln, peer = self.best_kiln(), self.best_peer()
        return round(peer.median_ms / kiln.median_ms, 3) if kiln and peer else None

    def to_dict(self) -> dict:
        d = asdict(self)
        peer = self.best_peer()
        d["best_peer"] = peer.name if peer else None
        d["speedup_vs_best_peer"] = self.vs_best_peer()
        return d

    def table(self) -> str:
        head = (f"{self.model} on {self.device}, dtype asked {self.dtype}, batch {self.batch}"
                + (f", {self.flops / 1e9:.2f} GFLOP/call" if self.flops else "")
                + (f", GEMM peak {self.gemm_peak_gflops:.0f} GFLOP/s" if self.gemm_peak_gflops else ""))
        w = max([26] + [len(r.name) + 2 for r in self.rows])
        cols = f"{'peer':<{w}}{'dtype':<10}{'median ms':>10}{'p90':>9}{'p99':>9}{'items/s':>10}{'x eager':>9}" \
               f"{'rel err':>10}{'setup s':>9}{'mem MB':>9}{'%peak':>7}"
        lines = [head, cols, "-" * len(cols)]
        for r in self.rows:
            mem = f"{r.peak_mem_mb:.0f}" if r.peak_mem_mb is not None else "-"
            frac = f"{100 * r.peak_frac:.0f}" if r.peak_frac is not None else "-"
            lines.append(f"{r.name:<{w}}{r.dtype:<10}{r.median_ms:>10.2f}{r.p90_ms:>9.2f}{r.p99_ms:>9.2f}"
                         f"{r.throughput:>10.1f}{r.speedup:>9.2f}{r.rel_err:>10.2g}{r.setup_s:>9.1f}{mem:>9}{frac:>7}"
                         + (f"  {r.note}" if r.note else ""))
        kiln, peer = self.best_kiln(), self.best_peer()
        if kiln and peer:
            lines.append(f"{kiln.name} vs best peer ({peer.name}), both {peer.dtype}: {self.vs_best_peer():.2f}x")
        elif kiln:
            lines.append(f"{kiln.name} served {kiln.dtype}: no {kiln.dtype} peer besides eager was timed")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("--plot needs matplotlib: pip install 'torchkiln[plot]'") from e
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(self.rows) + 1.5))
        names = [r.name for r in self.rows]
        vals = [r.median_ms for r in self.rows]
        colors = ["#d9480f" if n.startswith("torchkiln") else "#868e96" for n in names]
        ax.barh(names, vals, color=colors)
        for i, r in enumerate(self.rows):
            ax.text(r.median_ms, i, f" {r.median_ms:.2f} ms ({r.speedup:.2f}x)", va="center")
        ax.invert_yaxis()
        ax.set_xlabel("median latency (ms, lower is better)")
        ax.set_title(f"{self.model}: {self.device} {self.dtype} batch {self.batch}")
        ax.set_xlim(0, max(vals) * 1.35)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def model_flops(model: nn.Module, sample: inputs.Args) -> float | None:
    """FLOPs of one forward, counted by torch's FlopCounterMode (matmuls, convs, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(*sample[0], **sample[1])
        return float(counter.get_total_flops()) or None
    except Exception:
        return None


def gemm_peak(dtype: torch.dtype, device: torch.device, n: int | None = None, iters: int = 10) -> float:
    """GFLOP/s of the fastest GEMM path this machine has for ``dtype``, on an n^3 product.
    ``n`` defaults to 2048 on a CPU and 8192 on an accelerator: a 2048^3 bf16 product takes ~20 us
    on an H200, no longer than the synchronisation each timed call includes, and read 413 TFLOP/s
    there against 778 at 8192 (train_step.py's MFU was against the low figure until 2026-11-23)."""
    n = n or (2048 if device.type == "cpu" else 8192)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    paths = {"aten": lambda: a @ b}
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), n)
        paths["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    best = 0.0
    with torch.no_grad():
        for fn in paths.values():
            times = _time(fn, (), {}, device, warmup=2, iters=iters)
            best = max(best, 2 * n**3 / statistics.median(times) / 1e9)
    return round(best, 1)


# Each round's warm-up runs at least this long. After another peer ran, the first two calls of a
# sub-millisecond model ran 2-3x and 1.3-1.9x its steady time on the 2-core Zen 4 (thirty-fifth session,
# RESULTS.md: the switch between forms), so one warm-up call left one slow call in each block of a
# 0.35-ms MLP's rounds; 20-200 ms models still warm with one call.
WARM_S = 0.02


def _time(fn: Callable, args, kwargs, device, warmup: int, iters: int, tick=None, warm_s: float = 0.0) -> list[float]:
    """``iters`` timed calls after ``warmup`` calls, and more warm-up calls until ``warm_s`` has passed."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn(*args, **kwargs)
    synchronize(device)
    while warmup and time.perf_counter() - t0 < warm_s:
        fn(*args, **kwargs)
        synchronize(device)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(*args, **kwargs)
        synchronize(device)
        times.append(time.perf_counter() - t)
        if tick:
            tick()
    return times


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


@dataclass(frozen=True)
class Peer:
    dtype: str  # the compute dtype of the recipe
    build: Callable[[nn.Module], Callable]  # model copy -> callable; compiles lazily, on its first call


def peers_for(device: torch.device, dtype: torch.dtype, autotune: bool = False) -> dict[str, Peer]:
    """name -> Peer, nothing built yet. Mirrors what a skilled user tries: eager fp32
    first (the speedup baseline), then torchkiln.stock's recipes. The fp32 compile
    recipes are there even when a low dtype is asked, for when torchkiln serves fp32."""
    recipes = stock.eager_recipes(torch.float32)
    if device.type == "cpu":  # plain torch.compile: what most users try before freezing
        recipes.append(stock.StockRecipe("compile", "float32", compile=True))
    recipes += stock.compile_recipes(device, torch.float32, autotune=autotune)
    if dtype != torch.float32:
        recipes += stock.eager_recipes(dtype) + stock.compile_recipes(device, dtype, autotune=autotune)
    return {r.name: Peer(r.dtype, functools.partial(_build, r, device)) for r in recipes}


def _build(recipe: stock.StockRecipe, device: torch.device, model: nn.Module) -> Callable:
    # cudnn.benchmark for convolutions, as torchkiln sets it: a peer without it
    # would lose on algorithm choice, not on anything torchkiln adds.
    convs = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return stock.build(recipe, model, device, cudnn_benchmark=convs and device.type == "cuda")


@keeps_mode
@quiet_deprecations()  # torch's notices from what it runs are not the caller's (_log.py)
def bench(model: nn.Module, sample_input, dtype=None, device=None, level: str = "O1", warmup: int = 5,
          iters: int = 20, peers: list[str] | None = None, name: str = "model", progress: bool = True,
          gemm_peak_gflops: float | None = None, rounds: int = 5, autotune_peers: bool = False,
          **knobs) -> BenchResult:
    """Time torchkiln against stock peers on ``sample_input``. Inference (no_grad).

    Every peer is built first; then ``iters`` timed calls per peer are spread over
    ``rounds`` interleaved rounds (each after warm-up calls lasting at least
    ``WARM_S``, one call for slower models). ``autotune_peers``
    adds torch.compile ``max-autotune-no-cudagraphs`` peers (CUDA; slow to build)."""
    _log.configure()
    compute = parse_dtype(dtype)
    dev = torch.device(device) if device is not None else _model_device(model)
    if _model_device(model) != dev:
        model = copy.deepcopy(model).to(dev)
    sample = inputs.to(inputs.normalize(sample_input), dev)
    all_peers = peers_for(dev, compute, autotune=autotune_peers)
    kiln_variants = ("torchkiln", "torchkiln-O0", "torchkiln-O1", "torchkiln-O2")
    if peers is not None:
        bad = set(peers) - set(all_peers) - set(kiln_variants)
        if bad:
            raise ValueError(f"unknown peers {sorted(bad)}; available: {sorted(all_peers)} and {kiln_variants}")
        all_peers = {k: v for k, v in all_peers.items() if k in peers or k == "eager"}
    with torch.no_grad():
        ref = model(*sample[0], **sample[1])
    flops = model_flops(model, sample)
    asked = str(compute).removeprefix("torch.")
    result = BenchResult(model=name, device=str(dev), dtype=asked,
                         batch=inputs.batch_size(sample), flops=flops, gemm_peak_gflops=gemm_peak_gflops)
    builders: dict = dict(all_peers)
    for variant in kiln_variants:  # None marks a torchkiln build; the suffix is its level
        if (peers is None and variant == "torchkiln") or (peers is not None and variant in peers):
            builders[variant] = None
    # Build (and compile) every peer first, then time them interleaved in rounds:
    # drift on a noisy machine then hits all peers alike instead of whichever ran last.
    built: dict[str, tuple] = {}
    rounds = max(1, min(rounds, iters))
    with progress_bar(progress) as prog:
        task = prog.add_task("build + compile", total=len(builders)) if prog else None
        for peer, spec in builders.items():
            # A copy per stock peer so none can change another's weights (eager only reads them).
            own = model if spec is None or peer == "eager" else copy.deepcopy(model)
            # Memory baselines after that copy: a peer is charged for what it adds, not for it.
            synchronize(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            rss0 = _rss()
            t0 = time.perf_counter()
            with torch.no_grad():
                if spec is None:
                    lvl = peer.partition("-")[2] or level
                    fn = optimize(model, dtype=compute, level=lvl, sample_input=sample_input, device=dev, **knobs)
                else:
                    fn = spec.build(own)
                out = fn(*sample[0], **sample[1])
                synchronize(dev)
                setup = time.perf_counter() - t0
                _time(fn, *sample, dev, warmup=max(0, warmup - 1), iters=0)
            if dev.type == "cuda":
                mem = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
            else:
                mem = (_rss() - rss0) / 2**20
            err = compare(inputs.tree_map(lambda t: t.float() if t.is_floating_point() else t, out), ref)
            if spec is None:  # read after the first call: torchkiln may settle what it serves there
                served = getattr(fn.kiln_report, "dtype_served", None) or asked
                dtype_row, note = str(served).removeprefix("torch."), fn.kiln_report.active
            else:
                dtype_row, note = spec.dtype, ""
            built[peer] = (fn, setup, mem, err, dtype_row, note, [])
            if prog:
                prog.advance(task)
        task = prog.add_task("timing (interleaved)", total=rounds * len(built)) if prog else None
        per_round = [iters // rounds + (1 if r < iters % rounds else 0) for r in range(rounds)]
        with torch.no_grad():
            for n in per_round:
                for fn, *_, times in built.values():
                    times += _time(fn, *sample, dev, warmup=1, iters=n, warm_s=WARM_S)
                    if prog:
                        prog.advance(task)
    for peer, (_fn, setup, mem, err, dtype_row, note, times) in built.items():
        med = statistics.median(times)
        row = Row(name=peer, median_ms=med * 1e3, p90_ms=_pct(times, 0.9) * 1e3, p99_ms=_pct(times, 0.99) * 1e3,
                  throughput=(result.batch or 1) / med, peak_mem_mb=mem, setup_s=round(setup, 2),
                  rel_err=err.rel, dtype=dtype_row, note=note)
        if flops:
            row.gflops = flops / med / 1e9
            if gemm_peak_gflops:
                row.peak_frac = row.gflops / gemm_peak_gflops
        result.rows.append(row)
    eager = result.rows[0].median_ms
    for r in result.rows:
        r.speedup = round(eager / r.median_ms, 3)
    return result
