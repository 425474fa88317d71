"""After a failed ring attempt: probe the members and decide the next attempt (see ring.py, "Faults").

Split out of `ring.py` to keep that module to the round itself; the protocol is described there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ravnest_p2p.averaging.base import RingConfig
from ravnest_p2p.averaging.messages import RING_STATUS, StatusReply, StatusRequest
from ravnest_p2p.averaging.session import RingSession
from ravnest_p2p.transport import RpcEndpoint

__all__ = ["NextAttempt", "reform"]

logger = logging.getLogger(__name__)

_BEHIND_POLL_S = 0.5  # how often a closing round re-probes the members that have not reached it


@dataclass(frozen=True)
class NextAttempt:
    """What follows a failed attempt: `holders` of its whole mean (fetch it, `commit.py`), or the next
    attempt's number and members (None: this member is out of the round)."""

    attempt: int
    members: tuple[str, ...] | None
    holders: tuple[str, ...] = ()


async def reform(
    endpoint: RpcEndpoint,
    session: RingSession,
    config: RingConfig,
    deadline: float,
    *,
    wait_for_all: bool = False,
) -> NextAttempt:
    """Probe the failed attempt's members; return who holds its mean, or the next attempt.

    Members that hold the failed attempt's whole mean (same members: the attempt committed, `commit.py`)
    win over everything else. Otherwise a reply showing a later attempt is adopted as is (members None
    if this member is not in it); otherwise the next attempt is made of the members that answered and
    are still in the round. With `wait_for_all`,
    members that answer that they are behind (alive, in this epoch's ring, not in this round yet) are
    probed again every `_BEHIND_POLL_S` until they arrive or the round deadline is near; they are left
    out only then. Waiting uses no attempt: `max_attempts` counts failures, not late members.
    """
    me = endpoint.peer_id
    failed = session.attempt
    others = [m for m in session.members if m != me]
    request = StatusRequest(
        ring_id=session.ring_id, epoch=session.epoch, round=session.round, failed_attempt=failed
    )
    logged = False
    while True:
        timeout_s = max(0.01, min(config.probe_timeout_s, deadline - time.monotonic()))
        replies = await asyncio.gather(
            *(endpoint.call(m, RING_STATUS, request, timeout_s=timeout_s) for m in others),
            return_exceptions=True,
        )
        alive: set[str] = {me}
        behind: set[str] = set()
        ahead: StatusReply | None = None
        holders: list[str] = []
        for member, reply in zip(others, replies, strict=True):
            if isinstance(reply, asyncio.CancelledError):
                raise reply
            if isinstance(reply, BaseException):
                logger.debug("probe of %s failed: %r", member, reply)
                continue
            status = reply.message
            if status.holds == failed and tuple(status.members) == session.members:
                holders.append(member)
            if status.alive and not status.done:
                alive.add(member)
                if status.attempt > failed and (ahead is None or status.attempt > ahead.attempt):
                    ahead = status
            elif status.behind:
                behind.add(member)
        if holders:
            return NextAttempt(failed, session.members, tuple(holders))
        if ahead is not None:
            return NextAttempt(ahead.attempt, tuple(ahead.members) if me in ahead.members else None)
        if not (wait_for_all and behind and time.monotonic() + 2 * _BEHIND_POLL_S < deadline):
            return NextAttempt(failed + 1, tuple(m for m in session.members if m in alive))
        if not logged:
            logger.info("ring %s round %d: waiting for %s, behind", session.ring_id, session.round, behind)
            logged = True
        await asyncio.sleep(_BEHIND_POLL_S)
