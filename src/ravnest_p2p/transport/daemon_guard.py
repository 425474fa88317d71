"""A guard for a race in hivemind's daemon client that silences a peer's unary RPCs for good.

Problem. hivemind 1.1.12's `ControlClient` keeps one future per outgoing unary call in
`_pending_calls` and resolves it from one reader task (`_read_from_persistent_conn`). When a caller's
deadline cancels its call, the future is cancelled at once, but it leaves `_pending_calls` only when the
cancelled task next runs. A reply that arrives in between (a late reply, exactly at the deadline: common
on a busy host) makes the reader call `set_result` on a cancelled future: `InvalidStateError` ends the
reader task, and from then on no unary reply and no inbound unary request of that peer is ever handled
(this error was logged, "Task exception was never retrieved ... _read_from_persistent_conn ...
InvalidStateError", in a test run where one stage ran fewer than 3 averaging rounds instead of ~350; the
link between the two is likely, not proven).

Fix. `guard_pending_calls` swaps the dict for one that hands the reader a throwaway future for a call
that is already done, so a late reply is dropped, as hivemind means it to be. Nothing else changes: a
call that is still waiting gets its own future.

Alternatives rejected: patching the installed package (lost on reinstall); wrapping every call in a
shield (the reply would still race the cancellation).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["GuardedCalls", "guard_pending_calls"]

logger = logging.getLogger(__name__)


class GuardedCalls(dict[Any, "asyncio.Future[Any]"]):
    """`_pending_calls` whose done (e.g. cancelled) futures read as fresh throwaway ones."""

    dropped = 0

    def __getitem__(self, key: Any) -> asyncio.Future[Any]:
        future = super().__getitem__(key)
        if future.done():
            GuardedCalls.dropped += 1
            logger.debug("dropped a reply to a call that already ended (%s)", key)
            return asyncio.get_running_loop().create_future()
        return future


def guard_pending_calls(p2p: Any) -> bool:
    """Guard the daemon client of hivemind `P2P` object `p2p`; False if its layout is not the known one."""
    control = getattr(getattr(p2p, "_client", None), "control", None)
    calls = getattr(control, "_pending_calls", None)
    if not isinstance(calls, dict):
        logger.warning("hivemind's daemon client has no _pending_calls dict: late replies are unguarded")
        return False
    if not isinstance(calls, GuardedCalls):
        control._pending_calls = GuardedCalls(calls)  # type: ignore[union-attr]
    return True
