"""Logging setup that happens only when asked: by the CLI, or by the first
public call when TORCHKILN_LOG is set. Importing torchkiln configures nothing."""

from __future__ import annotations

import logging
import os

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_handler: logging.Handler | None = None


def configure(level: str | None = None) -> None:
    """Attach one stderr handler to the ``torchkiln`` logger (never the root logger).

    ``level`` defaults to $TORCHKILN_LOG; with neither, nothing is configured and
    records propagate to whatever logging the application set up.
    """
    global _handler
    level = level or os.environ.get("TORCHKILN_LOG")
    if not level:
        return
    key = level.strip().lower()
    if key not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    logger = logging.getLogger("torchkiln")
    logger.setLevel(LEVELS[key])
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(_handler)


_warned: set = set()


def warn_once(key: str, msg: str, stacklevel: int = 3) -> None:
    """A UserWarning the first time ``key`` is seen in this process; always logged."""
    import warnings

    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=stacklevel)
    logging.getLogger("torchkiln").info(msg)
