"""Logging setup that happens only when asked: by the CLI, or by the first
public call when TORCHKILN_LOG is set. Importing torchkiln configures nothing."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
import weakref

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_handler: logging.Handler | None = None


def configure(level: str | None = None) -> None:
    """Attach one stderr handler to the ``torchkiln`` logger (never the root logger).

    ``level`` defaults to $TORCHKILN_LOG; with neither, nothing is configured and
    records propagate to whatever logging the application set up.
    """
    global _handler
    env = not level
    level = level or os.environ.get("TORCHKILN_LOG")
    if not level:
        return
    key = level.strip().lower()
    if key not in LEVELS:
        if env:  # a typo in the environment must not stop every command and tk.llm.optimize: said, ignored
            warn_once(f"log-env:{level}", f"torchkiln: TORCHKILN_LOG={level!r} is not one of "
                      f"{', '.join(LEVELS)}; ignored")
            return
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    logger = logging.getLogger("torchkiln")
    logger.setLevel(LEVELS[key])
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(_handler)


_warned: set = set()
# Per-object keys live as long as the object: keyed by id() they were inherited by the next model
# that happened to reuse the address, which then never warned (seen in CI: a test's second model).
_warned_by: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def user_level() -> int:
    """The ``stacklevel`` (as counted from warn_once's own ``warnings.warn``) of the first frame outside
    torch and torchkiln: the user's line, however deep in nn.Module's and torch.jit's machinery a call
    warns from (a fixed count pointed into torch once the returned model's forward gained a frame)."""
    import torch

    inside = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__package__]))
    frame, level = sys._getframe(2), 2  # warn_once's caller is level 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def warn_once(key: str, msg: str, stacklevel: int | None = 3, owner: object = None) -> None:
    """A UserWarning the first time ``key`` is seen in this process (for ``owner``, when given:
    once per that object's life); always logged. ``stacklevel=None``: the user's line (``user_level``)."""
    import warnings

    try:
        seen = _warned if owner is None else _warned_by.setdefault(owner, set())
    except TypeError:  # not weak-referenceable: once per process
        seen = _warned
    if key not in seen:
        seen.add(key)
        warnings.warn(msg, stacklevel=user_level() if stacklevel is None else stacklevel)
    logging.getLogger("torchkiln").info(msg)


# Modules whose deprecation notices, raised by what torchkiln itself calls, are not the caller's to act
# on: torch 2.13's inductor imports torch.utils.mkldnn, whose torch.jit.script_method notice, under a
# test suite's `filterwarnings = error`, failed every compiled candidate and stock torch.compile too
# (a bert-base bf16 served at 1.03x eager); under pytest's default filters ~15 such notices came out
# of each optimize(). ("torch(\\.|$)": the regex matches from the start, and "torch" alone would match
# torchkiln, whose own warnings always reach the caller.)
_DRIVEN = r"(torch|torchao)(\.|$)"


@contextlib.contextmanager
def quiet_deprecations():
    """Around torchkiln's builds, verification and timing: torch's and torchao's deprecation notices
    are ignored, every other warning is filtered as the caller set it. catch_warnings swaps the
    process-wide filter list (before Python 3.14), so a filter another thread adds meanwhile is lost
    when this exits, and two threads' overlapping builds can leave these ignores in place. A lock
    would not do: a build holding it could wait on a model's lock held by a thread waiting for it."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=_DRIVEN)
        yield
