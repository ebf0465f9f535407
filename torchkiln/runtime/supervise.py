"""Running the planned processes: prefixed output, log files, forwarded signals, the worst exit code.

Each child gets its own session, so a Ctrl-C in the terminal reaches the launcher alone and is
forwarded once, to the child's whole process group (its own workers included), instead of twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from .launch import InstanceLaunch

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(returncode: int) -> int:
    """A child killed by signal N reports -N; shells (and we) say 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _affinity(cpus: tuple[int, ...]):
    # Runs in the child between fork and exec. All children are started before any reader thread,
    # so the fork happens while this process is single-threaded, where preexec_fn is safe.
    def set_mask():
        os.sched_setaffinity(0, cpus)

    return set_mask


def _pump(proc: subprocess.Popen, prefix: str, log: Path | None, out: TextIO, lock: threading.Lock) -> None:
    # Appended, under a header per run: an earlier run's log in the same --log-dir was overwritten
    with open(log, "ab") if log else open(os.devnull, "wb") as sink:
        if log:
            sink.write(f"=== torchkiln run, {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {proc.pid} ===\n".encode())
        for raw in iter(proc.stdout.readline, b""):
            sink.write(raw)
            text = raw.decode(errors="replace")
            with lock:
                out.write(prefix + (text if text.endswith("\n") else text + "\n"))
                out.flush()


def run_processes(launches: Sequence[InstanceLaunch], log_dir: str | None = None, prefix: bool = True,
                  out: TextIO | None = None, environ: dict | None = None) -> list[int]:
    """Start every process, stream its output, wait for all; their exit codes in order."""
    out = sys.stdout if out is None else out
    environ = os.environ if environ is None else environ
    if log_dir:
        if Path(log_dir).exists() and not Path(log_dir).is_dir():
            raise ValueError(f"--log-dir {log_dir!r} is a file, not a folder")
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass

    try:
        previous = {s: signal.signal(s, forward) for s in _SIGNALS}
    except ValueError:  # not the main thread: signals stay with whoever owns them
        previous = {}
    try:
        for launch in launches:
            preexec = _affinity(launch.cpus) if launch.bind == "affinity" else None
            procs.append(subprocess.Popen(
                list(launch.command), env={**environ, **launch.env}, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec))
        lock = threading.Lock()
        readers = [
            threading.Thread(target=_pump, daemon=True, args=(
                p, f"[{launch.index}] " if prefix else "",
                Path(log_dir) / f"instance_{launch.index}.log" if log_dir else None, out, lock))
            for p, launch in zip(procs, launches, strict=True)
        ]
        for t in readers:
            t.start()
        codes = [exit_code(p.wait()) for p in procs]
        for t in readers:
            t.join()
        return codes
    finally:
        for p in procs:  # only on an error of our own: a child still running is not left behind
            if p.poll() is None:
                forward(signal.SIGTERM, None)
                break
        for s, handler in previous.items():
            signal.signal(s, handler)
