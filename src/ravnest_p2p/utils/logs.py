"""Logging has one owner: only entry points (CLI, notebook helper) call `configure_logging`."""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_logging"]

_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"


def configure_logging(level: str = "INFO") -> None:
    """Install one stderr handler on the root logger; quieten hivemind's chatty loggers below WARNING."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(numeric)
    if numeric > logging.DEBUG:
        for name in ("hivemind", "p2pd"):
            logging.getLogger(name).setLevel(logging.WARNING)
