"""`torchkiln demo | bench | check`: the inference subcommands."""

from __future__ import annotations

import json
import os
from datetime import date


def _shape(text: str | None):
    if not text:
        return None
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--shape {text!r} is not a comma-separated list of ints, e.g. 1,3,224,224") from None
    if any(n < 1 for n in shape):  # a negative size was a traceback, a zero one an empty "ok" check
        raise ValueError(f"--shape {text!r}: every size must be at least 1, e.g. 1,3,224,224")
    return shape


def _dtype(text: str):
    """--dtype as a torch dtype; the error names the option, not parse_dtype's keyword."""
    from .modelutil import parse_dtype

    try:
        return parse_dtype(text)
    except ValueError:
        raise ValueError(f"--dtype {text!r} is not supported; use float32, bfloat16 or float16 "
                         "(or fp32, bf16, fp16)") from None


def _add_model_args(p, default_batch: int = 1, default_dtype: str = "float32", extra: str = "") -> None:
    # the zoo's names written out: importing zoo would import torch for --help
    p.add_argument("model", help="zoo name (resnet50, resnet50-hf, mobilenet-v2, efficientnet-b0, bert-base, vit-base, "
                               "gpt2, llama-small, mlp) or package.module:callable" + extra)
    p.add_argument("--batch", type=int, default=default_batch)
    p.add_argument("--seq", type=int, default=128, help="sequence length for text models")
    p.add_argument("--shape", help="input shape for a callable that returns a bare model, e.g. 1,3,224,224")
    p.add_argument("--dtype", default=default_dtype, help=f"float32 | bfloat16 | float16 (default {default_dtype})")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: where the model is)")
    p.add_argument("--level", default="O1", choices=["O0", "O1", "O2"])


def _check_device(args) -> None:
    """--device names a usable device (else a clear error, before any model is built)."""
    if args.device:
        from .hardware import resolve_device

        resolve_device(args.device, arg="--device {!r}")


def _model_args_ok(args) -> None:
    """Fail fast on bad model options, before building a model (or printing the demo's banner)."""
    from . import zoo

    _dtype(args.dtype)
    for name in ("batch", "seq"):
        if getattr(args, name, 1) < 1:
            raise ValueError(f"--{name} {getattr(args, name)}: must be at least 1")
    zoo.check_name(args.model)
    _check_device(args)


def _load(args):
    """The model and sample the (already checked) options name."""
    import torch

    from . import zoo

    model, sample = zoo.load(args.model, batch=args.batch, seq=args.seq, shape=_shape(args.shape))
    if args.device:
        from .inputs import normalize, to

        model = model.to(torch.device(args.device))
        a, k = to(normalize(sample), args.device)
        # back in the sample's own form: (args, kwargs) passed on as one sample was called as a tuple
        # (every --device failed, even cpu: the CLI probe, 2026-11-26)
        sample = k if isinstance(sample, dict) else a[0] if isinstance(sample, torch.Tensor) else a
    return model, sample


PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def _outputs(args) -> None:
    """Check --plot and --results before any work (they failed only after a whole benchmark, the results
    lost): a plot path without an extension gets .png (matplotlib's default, which it adds itself: an
    existing chart.png was overwritten without --force); its format must be one matplotlib writes; an
    existing plot needs --force (--results appends); missing parent folders are created."""
    plot = getattr(args, "plot", None)
    if plot:
        ext = os.path.splitext(plot)[1].lstrip(".").lower()
        if not ext:
            args.plot = plot = plot + ".png"
        elif ext not in PLOT_FORMATS:
            raise ValueError(f"--plot {plot!r}: {ext!r} is not a chart format; use one of {', '.join(PLOT_FORMATS)}")
    for option, path in (("--plot", plot), ("--results", getattr(args, "results", None))):
        if path:
            if os.path.isdir(path):
                raise ValueError(f"{option} {path!r} is a folder; give a file name")
            if option == "--plot" and os.path.exists(path) and not getattr(args, "force", False):
                raise FileExistsError(f"--plot {path!r} exists; pass --force to overwrite it")
            parent = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                raise ValueError(f"{option} {path!r}: cannot create its folder {parent!r} ({e.strerror})") from e


def _bench(args, model_name: str, banner: str | None = None) -> int:
    """``banner``: printed (without --json) once the options are checked, before the model is built."""
    import torch

    from .bench import bench, gemm_peak

    _outputs(args)
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters {args.iters} / --warmup {args.warmup}: need at least 1 timed call and no "
                         "negative warm-up")
    _model_args_ok(args)
    if banner and not args.json:
        print(banner)
    model, sample = _load(args)
    dtype = _dtype(args.dtype)
    device = torch.device(args.device) if args.device else torch.device("cpu")
    peak = gemm_peak(dtype, device) if args.peak else None
    peers = args.peers.split(",") if args.peers else None
    result = bench(model, sample, dtype=dtype, device=device, level=args.level, warmup=args.warmup,
                   iters=args.iters, peers=peers, name=model_name, progress=not args.json and not args.no_progress,
                   gemm_peak_gflops=peak, autotune_peers=args.autotune_peers)
    if args.plot:
        result.plot(args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result.table())
        if args.plot:
            print(f"plot written to {args.plot}")
    if args.results:
        cmd = "torchkiln " + " ".join(args._argv)
        with open(args.results, "a") as f:
            f.write(f"\n### {date.today()} `{cmd}`\n\n```\n{result.table()}\n```\n")
    return 0


def _cmd_bench(args) -> int:
    if args.model == "llm":
        return _bench_llm(args)
    if args.peer == "ipex":
        return _bench_ipex(args)
    return _bench(args, args.model)


def _bench_ipex(args) -> int:
    """`torchkiln bench MODEL --peer ipex`: torchkiln, IPEX 2.8 (its own venv) and stock
    torch.compile, each in its own served process, timed in interleaved rounds."""
    from . import ipex_peer, zoo
    from .progress import ticks

    if args.model not in zoo.MODELS:
        raise ValueError(f"--peer ipex runs zoo models (each peer builds its own copy in its own process); "
                         f"{args.model!r} is not one of {sorted(zoo.MODELS)}")
    if args.shape or args.device not in (None, "cpu") or args.level != "O1" or args.plot or args.peak:
        raise ValueError("--peer ipex compares CPU inference at the default level; drop --shape, --device, "
                         "--level, --plot and --peak")
    _outputs(args)
    peers = tuple(args.peers.split(",")) if args.peers else ipex_peer.PEERS
    with ticks(not args.json and not args.no_progress, "IPEX peer: builds, rounds", len(peers) + args.rounds) \
            as tick:
        cell = ipex_peer.compare(args.model, args.dtype, args.batch, peers, args.rounds, args.iters,
                                 args.ipex_python, args.seq, tick=tick)
    table = f"{ipex_peer.HEADER}\n{cell.row()}"
    if args.json:
        print(json.dumps(cell.to_dict(), indent=2, default=str))
    else:
        print(table)
    if args.results:
        cmd = "torchkiln " + " ".join(args._argv)
        with open(args.results, "a") as f:
            f.write(f"\n### {date.today()} `{cmd}`\n\n{table}\n")
    return 0


def _bench_llm(args) -> int:
    """`torchkiln bench llm`: tk.llm against transformers' generate (eager and static cache)."""
    from .llm import bench as llm_bench

    if args.config not in llm_bench.CONFIGS:
        raise ValueError(f"--config {args.config!r} is not one of {sorted(llm_bench.CONFIGS)}")
    quant = tuple(q for q in (args.quant or "").split(",") if q)
    bad = [q for q in quant if q not in ("int8", "int4")]
    if bad:
        raise ValueError(f"--quant {bad[0]!r} is not int8 or int4 (a comma list: --quant int8,int4)")
    peers = tuple(args.peers.split(",")) if args.peers else llm_bench.PEERS[:3]
    unknown = [p for p in peers if p not in llm_bench.PEERS]
    if unknown:
        raise ValueError(f"--peers {unknown[0]!r} is not one of {', '.join(llm_bench.PEERS)}")
    for name, least in (("batch", 1), ("prompt", 1), ("new_tokens", 1), ("rounds", 1), ("lookup", 0)):
        value = getattr(args, name)
        if value is None or value < least:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least {least}")
    dtype = _dtype(args.dtype)
    _check_device(args)
    _outputs(args)
    rows, info = llm_bench.run(args.config, args.device or "cpu", dtype, quant, args.batch,
                               args.prompt, args.new_tokens, args.rounds, peers,
                               progress=not args.json and not args.no_progress, lookup=args.lookup)
    if args.json:
        print(json.dumps({"info": info, "rows": [r.__dict__ for r in rows]}, indent=2, default=str))
    else:
        print(llm_bench.table(rows, info))
    if args.results:
        cmd = "torchkiln " + " ".join(args._argv)
        with open(args.results, "a") as f:
            f.write(f"\n### {date.today()} `{cmd}`\n\n{llm_bench.table(rows, info)}\n")
    return 0


def _default_demo_model() -> str:
    """bert-base shows where stock PyTorch leaves the most on the table (fp32 GEMMs,
    short-sequence attention); it needs the transformers extra, resnet50 does not."""
    import importlib.util

    return "bert-base" if importlib.util.find_spec("transformers") else "resnet50"


def _demo_peers(dtype: str) -> str:
    """compile+freezing, the strongest stock CPU recipe, at fp32 and at the asked dtype:
    torchkiln is compared at the dtype it serves, which may be fp32 after a fallback."""
    import torch

    from .bench import peers_for

    names = [n for n in peers_for(torch.device("cpu"), _dtype(dtype)) if n.startswith("compile+freezing")]
    return ",".join([*names, "torchkiln"])


def _cmd_demo(args) -> int:
    args.model = args.model or _default_demo_model()
    args.shape, args.device, args.level, args.results = None, None, "O1", None
    args.peak, args.autotune_peers = True, False
    args.peers = args.peers or _demo_peers(args.dtype)
    return _bench(args, args.model, banner=f"torchkiln demo: optimizing a built-in {args.model} (random weights) "
                  f"at batch {args.batch} and timing it against stock PyTorch in this process...\n")


def _cmd_check(args) -> int:
    from .check import check

    _model_args_ok(args)
    model, sample = _load(args)
    result = check(model, sample, dtype=args.dtype, level=args.level)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result)
    return 0 if result.ok else 1


def register(sub, common) -> None:
    b = sub.add_parser("bench", parents=[common], help="time torchkiln against stock PyTorch peers")
    _add_model_args(b, extra="; `bench llm` times tk.llm decoding")
    b.add_argument("--iters", type=int, default=20)
    b.add_argument("--warmup", type=int, default=5)
    b.add_argument("--peers", help="comma list of peers (default: all for this device and dtype)")
    b.add_argument("--autotune-peers", action="store_true",
                   help="also time torch.compile max-autotune-no-cudagraphs peers (CUDA; slow to build)")
    b.add_argument("--plot", help="write a bar chart PNG here")
    b.add_argument("--force", action="store_true", help="overwrite an existing --plot file")
    b.add_argument("--peak", action="store_true", help="also measure the GEMM peak and report %% of it")
    b.add_argument("--results", help="append the table to this markdown file (e.g. benchmarks/RESULTS.md)")
    b.add_argument("--no-progress", action="store_true")
    i = b.add_argument_group("bench MODEL --peer ipex: against IPEX 2.8 in its own venv (benchmarks/ipex_env.sh)")
    i.add_argument("--peer", choices=["ipex"], help="run IPEX, stock torch.compile and torchkiln in separate "
                                                    "processes, interleaved (--dtype float32|bfloat16|int8, "
                                                    "--peers from compile,ipex,torchkiln, --rounds, --iters)")
    i.add_argument("--ipex-python", help="the IPEX venv's python (default: $TORCHKILN_IPEX_PYTHON, else "
                                         "~/.cache/torchkiln/ipex-venv/bin/python)")
    g = b.add_argument_group("bench llm (MODEL = llm): decode speed against transformers' generate")
    g.add_argument("--config", default="llama-125m", help="llama-125m | llama-350m | llama-1b | llama-3-8b "
                                                         "(random weights)")
    g.add_argument("--quant", default="", help="also time weight-only int8/int4: e.g. int8,int4")
    g.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--rounds", type=int, default=5)
    g.add_argument("--lookup", type=int, default=0, help="also time prompt-lookup speculation with K drafts")
    b.set_defaults(func=_cmd_bench)

    d = sub.add_parser("demo", parents=[common], help="optimize a built-in model and show the side-by-side")
    d.add_argument("--model", default=None, help="zoo model (default: bert-base with transformers installed, "
                                                 "else resnet50)")
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--seq", type=int, default=128)
    d.add_argument("--dtype", default="float32")
    d.add_argument("--iters", type=int, default=10)
    d.add_argument("--warmup", type=int, default=3)
    d.add_argument("--peers", default=None, help="peers besides eager (default: torchkiln and compile+freezing, "
                                                 "the strongest stock CPU recipe, at fp32 and at --dtype)")
    d.add_argument("--plot", help="write a bar chart PNG here")
    d.add_argument("--force", action="store_true")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("check", parents=[common], help="consistency checks: modes, devices, dtypes, optimized")
    # bfloat16 by default: the low-precision path is where checks find most (the --dtype float32 a user
    # passes was once read as "not given" and checked bfloat16: the new-user sweep, 2026-11-23)
    _add_model_args(c, default_dtype="bfloat16")
    c.set_defaults(func=_cmd_check)
