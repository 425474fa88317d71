"""Where a re-plan's downtime goes, from the peers' logs of a churn soak run (second resolution).

For every churn event: seconds from the event to the first peer opening a new plan epoch (detection),
to a new plan being active (agreement), to a stage's state arriving (hand-over), to a first stage
resuming (the first evaluation on the new plan), and to the first progress on the new plan (the
timeline's `training_again_s`). Also counts the failure lines that re-plan without a churn event
(e.g. a starved neighbour that answered too late). Log lines are ``HH:MM:SS LEVEL [module] text`` in
the host's local time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["phase_times", "spurious_failures"]

_PHASES = {
    "detected_s": re.compile(r"opening epoch \d+"),
    "plan_active_s": re.compile(r"plan \w+ active for epoch \d+: [1-9]"),
    "state_arrived_s": re.compile(r"stage state from"),
    "resumed_s": re.compile(r"resumed at micro-batch"),
}
_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) ")
_FAILURE = re.compile(r"lost: no answer for|lost: forward failed|lost: backward failed")


def _stamped(paths: Sequence[Path], day_start: float) -> list[tuple[float, str]]:
    out = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if m:
                h, mi, s = (int(g) for g in m.groups())
                out.append((day_start + 3600 * h + 60 * mi + s, line))
    return sorted(out)


def _day_start(t: float) -> float:
    lt = time.localtime(t)
    return t - (3600 * lt.tm_hour + 60 * lt.tm_min + lt.tm_sec + (t % 1))


def phase_times(workdir: Path, events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per event (wall time ``t``): seconds to each phase's first log line after it (None: not seen
    before the next event)."""
    if not events:
        return []
    lines = _stamped(sorted(workdir.glob("peer*.log")), _day_start(events[0]["t"]))
    out = []
    for i, ev in enumerate(events):
        start = int(ev["t"])  # log stamps are whole seconds
        end = events[i + 1]["t"] if i + 1 < len(events) else float("inf")
        row: dict[str, Any] = {"action": ev["action"], "peer": ev["peer"]}
        after: float = start
        for name, pattern in _PHASES.items():
            hit = next((t for t, text in lines if after <= t < end and pattern.search(text)), None)
            row[name] = None if hit is None else hit - start
            after = hit if hit is not None else after
        out.append(row)
    return out


def spurious_failures(workdir: Path, left: Sequence[str]) -> int:
    """Stage failures that blame a neighbour that never left (`left`: peer ids that did)."""
    count = 0
    for path in workdir.glob("peer*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "ERROR" in line and _FAILURE.search(line) and not any(p in line for p in left):
                count += 1
    return count
