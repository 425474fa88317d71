"""Small helpers with no knowledge of the network: deadlines, polling, task ownership, compute thread."""

from ravnest_p2p.utils.aio import (
    StretchedDeadline,
    TaskOwner,
    load_stretch,
    run_in_compute_thread,
    wait_until,
)
from ravnest_p2p.utils.logs import configure_logging

__all__ = [
    "StretchedDeadline",
    "TaskOwner",
    "configure_logging",
    "load_stretch",
    "run_in_compute_thread",
    "wait_until",
]
