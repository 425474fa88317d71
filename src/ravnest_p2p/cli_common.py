"""Shared bits of the command-line entry points: one-line errors, TOML config files, the event loop."""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

__all__ = ["OneLineArgumentParser", "fail", "format_validation_error", "load_toml", "run_loop"]


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)", code=2, prog=self.prog)


def fail(message: str, *, code: int = 1, prog: str = "ravnest_p2p") -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def format_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def load_toml(path: str) -> dict[str, Any]:
    try:
        with Path(path).open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run the entry point's coroutine on uvloop (plain asyncio if uvloop is unavailable)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but keep the CLI usable without it
        import asyncio

        return asyncio.run(main)
    return int(uvloop.run(main))
