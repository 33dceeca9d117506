"""Logging for mlxr: its loggers and uvicorn's, never other libraries' levels (set up by the
``mlxr`` commands and by the engine process)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from mlxr_core.config.schema import LOG_LEVELS
from mlxr_core.errors import ConfigError

#: Loggers configured by :func:`setup_logging`: the core, the built-in plugins, third-party plugins
#: that log under ``mlxr.*``, and the HTTP server.
LOGGERS = ("mlxr_core", "mlxr_plugins", "mlxr", "uvicorn")
#: uvicorn's level below DEBUG.
TRACE = 5
FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def parse_level(level: str) -> int:
    """``"info"`` (any case) -> ``logging.INFO``; ``"trace"`` -> 5 (uvicorn's)."""
    name = level.strip().lower()
    if name not in LOG_LEVELS:
        raise ConfigError(f"unknown log level {level!r} (one of {', '.join(LOG_LEVELS)})")
    if name == "trace":
        return TRACE
    numeric: int = logging.getLevelName(name.upper())
    return numeric


def setup_logging(level: str, *, stream: TextIO | None = None) -> int:
    """Send mlxr's and uvicorn's log records at ``level`` and above to ``stream`` (stderr).

    Only :data:`LOGGERS` are configured: the root logger, and so every other library, is left as
    it was. They stop propagating to the root so a library that configures the root logger does not
    print each line twice. Calling it again replaces the handler it installed before. Without
    ``stream``, records go to whatever ``sys.stderr`` is when each is written (a test harness may
    swap it and close the one it replaced).

    :return: the numeric level.
    """
    numeric = parse_level(level)
    if numeric == TRACE:
        logging.addLevelName(TRACE, "TRACE")
    handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.set_name("mlxr")
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == "mlxr"]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(numeric)
        logger.propagate = False
    return numeric


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to ``sys.stderr`` as it is at each record, not as it was when made."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr


def level_name() -> str:
    """The level :func:`setup_logging` last set, by name (``"warning"`` when it was never called):
    what a child process passes to it to log as its parent does."""
    numeric = logging.getLogger(LOGGERS[0]).level or logging.WARNING
    if numeric <= TRACE:
        return "trace"
    return logging.getLevelName(numeric).lower()
