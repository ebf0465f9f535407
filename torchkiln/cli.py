"""The `torchkiln` command. Every subcommand takes --json."""

from __future__ import annotations

import argparse
import functools
import json
import sys

from . import __version__, _log


def _gib(n):
    return f"{n / 2**30:.1f} GiB" if n else "?"


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _cmd_doctor(args) -> int:
    from . import doctor

    if args.probe_timeout is not None and not args.probe_timeout > 0:
        raise ValueError(f"--probe-timeout {args.probe_timeout}: must be a positive number of seconds")
    report = doctor.run(timeout=args.probe_timeout)
    if args.json:
        _print_json({"torchkiln": __version__, **report})
        return 0
    hw = report["hardware"]
    cpu, sw = hw["cpu"], hw["software"]
    print(f"torchkiln {__version__}  ({hw['platform']})")
    print(f"CPU      {cpu['vendor'] or '?'} {cpu['model'] or '?'}")
    print(
        f"         {cpu['physical_cores'] or '?'} physical cores, {cpu['sockets'] or '?'} socket(s), "
        f"{cpu['numa_nodes'] or '?'} NUMA node(s), {_gib(cpu['memory_bytes'])} RAM"
    )
    print(f"         ISA: {' '.join(cpu['features']) or 'none detected'}")
    for key, why in cpu["unknown"].items():
        print(f"         {key}: unknown ({why})")
    if not hw["accelerators"]:
        print("GPU      none visible to torch")
    for acc in hw["accelerators"]:
        state = "usable" if acc["usable"] else f"UNUSABLE: {acc['problem']}"
        dts = [d for d in ("bf16", "fp16", "fp8") if acc[d]]
        print(
            f"{acc['type'] + ':' + str(acc['index']):<9}{acc['name'] or '?'}, {_gib(acc['memory_bytes'])}, "
            f"capability {acc['capability'] or '?'}, native {'/'.join(dts) or '?'}  [{state}]"
        )
    backends = ", ".join(k for k, v in sw["backends"].items() if v)
    print(
        f"Software python {sw['python']}, torch {sw['torch']}, torchao {sw['torchao'] or '-'}, "
        f"transformers {sw['transformers'] or '-'}; torch backends: {backends}"
    )
    print(f"Devices  {', '.join(report['devices'])}  (default: {report['default_device']})")
    print(f"Malloc   {doctor.allocator_line(doctor.allocators())}")
    for dev, schemes in report.get("quantization", {}).items():
        print(f"Quant    {doctor.quant_line(dev, schemes)}  (tk.quantize schemes)")
    net = report["onednn_net"]
    print(f"CNN net  {'available: ' if net['available'] else 'not available: '}{net['detail']}  "
          "(CNNs as one oneDNN program: int8, float32 and bf16 with Winograd 3x3 convolutions)")
    for p in report["problems"]:
        print(f"PROBLEM  {p['device']}: {p['detail']}\n  cause: {p['cause']}\n  fix:   {p['fix']}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a bad choice, a missing value) as JSON on stdout when --json was given, so
    a script reading the output gets ``{"error": ...}`` for every bad call, not usage text it cannot
    parse. Exit code 2, as argparse's."""

    def __init__(self, *args, json_errors: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors

    def error(self, message):
        if self.json_errors:
            _print_json({"error": "UsageError", "message": f"{self.prog}: {message}"})
            self.exit(2)
        super().error(message)


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    """``json_errors``: argparse's own errors as JSON (main() decides it from the raw arguments)."""
    def shared(defaults: bool) -> argparse.ArgumentParser:
        # Given before or after the subcommand. The subcommands' copy has no defaults: with them, a
        # subcommand reset `torchkiln --json doctor`'s --json to False (the new-user sweep, 2026-11-23).
        kw = {} if defaults else {"default": argparse.SUPPRESS}
        c = argparse.ArgumentParser(add_help=False)
        c.add_argument("--json", action="store_true", help="print machine-readable JSON", **kw)
        c.add_argument("--log-level", choices=sorted(_log.LEVELS), help="verbosity (default: $TORCHKILN_LOG)", **kw)
        return c

    common = shared(False)
    p = _Parser(prog="torchkiln", description=__doc__, parents=[shared(True)], json_errors=json_errors)
    p.add_argument("--version", action="store_true", help="print the version (with --json: as JSON) and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND",
                           parser_class=functools.partial(_Parser, json_errors=json_errors))

    d = sub.add_parser("doctor", parents=[common], help="describe this machine and what is usable")
    d.add_argument("--probe-timeout", type=float, default=None, help="seconds per device probe (20)")
    d.set_defaults(func=_cmd_doctor)

    from . import commands
    from .runtime import command as run_command

    commands.register(sub, common)
    run_command.register(sub, common)
    return p


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    # --json among torchkiln's own arguments: those before `run`'s script (its arguments are the script's)
    parser = build_parser(json_errors="--json" in raw[:next((i for i, a in enumerate(raw) if a.endswith(".py")),
                                                             len(raw))])
    args = parser.parse_args(argv)
    args._argv = raw
    _log.configure(args.log_level)
    if args.version:
        if args.json:
            _print_json({"torchkiln": __version__})
        else:
            print(f"torchkiln {__version__}")
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except Exception as e:
        # User errors, and failures a command explains in full (``for_the_user``, e.g. an autotune whose
        # every layout failed): one clear message, not a traceback. Anything else is a bug: raised.
        if not isinstance(e, (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError)) \
                and not getattr(e, "for_the_user", False):
            raise
        if args.json:
            _print_json({"error": type(e).__name__, "message": str(e)})
        else:
            print(f"torchkiln: error: {e}", file=sys.stderr)
        return 2
