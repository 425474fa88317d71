"""The hostile-input suite's shared tally: every security test counts what it sent and what happened.

Each test takes the `hostile` fixture and adds to its own `HostileTally` (messages sent, refused, crashes,
stage failures, state changes, forged records accepted, peak RSS growth). At the end of a session the
tallies are summed; with ``RAVNEST_WRITE_RESULTS=1`` (set by ``make test-slow`` / ``make test-security``)
they are written to ``benchmarks/results/security.{json,md}``. A default ``make test`` run writes nothing,
so a clean checkout stays clean.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pytest

_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass
class HostileTally:
    """What one test threw at real peers and how they took it. Everything but `sent` should stay 0."""

    surface: str = ""  # e.g. "rpc:forward", "stream:ring", "dht:peers"
    sent: int = 0
    refused: int = 0
    crashes: int = 0
    stage_failures: int = 0
    state_changes: int = 0
    forged_accepted: int = 0
    peak_rss_growth_bytes: int = 0

    def merge(self, other: HostileTally) -> None:
        for f in fields(self):
            if f.name == "surface":
                continue
            if f.name == "peak_rss_growth_bytes":
                self.peak_rss_growth_bytes = max(self.peak_rss_growth_bytes, other.peak_rss_growth_bytes)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_TALLIES: dict[str, HostileTally] = {}


@pytest.fixture
def hostile(request: pytest.FixtureRequest) -> HostileTally:
    """A fresh tally for this test, collected into the session's report."""
    tally = HostileTally()
    _TALLIES[request.node.nodeid] = tally
    return tally


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _TALLIES or os.environ.get("RAVNEST_WRITE_RESULTS") != "1":
        return
    by_surface: dict[str, HostileTally] = {}
    total = HostileTally(surface="all")
    for tally in _TALLIES.values():
        by_surface.setdefault(tally.surface or "?", HostileTally(surface=tally.surface or "?")).merge(tally)
        total.merge(tally)
    rows = [asdict(t) for t in sorted(by_surface.values(), key=lambda t: t.surface)]
    _RESULTS.mkdir(parents=True, exist_ok=True)
    (_RESULTS / "security.json").write_text(
        json.dumps({"total": asdict(total), "by_surface": rows, "tests": len(_TALLIES)}, indent=2) + "\n"
    )
    cols = [f.name for f in fields(HostileTally)]
    lines = [
        "# Hostile-input suite",
        "",
        f"{len(_TALLIES)} tests (`make test-security`); python {sys.version.split()[0]}. Every column but "
        "`sent` and `refused` must be 0 (peak RSS growth: at most 64 MiB under a 100-stream slowloris).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in [*rows, asdict(total)]:
        lines.append("| " + " | ".join(str(row[c]) for c in cols) + " |")
    (_RESULTS / "security.md").write_text("\n".join(lines) + "\n")
