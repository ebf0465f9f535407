"""One progress-bar helper for long work (benchmarks, calibration)."""

from __future__ import annotations

import contextlib


class progress:
    """A rich progress bar on stderr (stdout stays clean for --json); nothing when off."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.prog = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.prog = Progress(TextColumn("{task.description:<26}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=Console(stderr=True), transient=False)
        self.prog.__enter__()
        return self.prog

    def __exit__(self, *exc):
        if self.prog is not None:
            self.prog.__exit__(*exc)
        return False


@contextlib.contextmanager
def ticks(enabled: bool, what: str, total: int):
    """One bar of ``total`` steps; yields the function that advances it (None when off)."""
    with progress(enabled) as prog:
        if prog is None:
            yield None
            return
        task = prog.add_task(what, total=total)
        yield lambda: prog.advance(task)
