"""After a failed ring attempt: probe the members and decide the next attempt (see ring.py, "Faults").

Split out of `ring.py` to keep that module to the round itself; the protocol is described there.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ravnest_p2p.averaging.base import RingConfig
from ravnest_p2p.averaging.messages import RING_STATUS, StatusReply, StatusRequest
from ravnest_p2p.averaging.session import RingSession
from ravnest_p2p.transport import RpcEndpoint

__all__ = ["reform"]

logger = logging.getLogger(__name__)

_BEHIND_POLL_S = 0.5  # how often a closing round re-probes the members that have not reached it


async def reform(
    endpoint: RpcEndpoint,
    session: RingSession,
    config: RingConfig,
    deadline: float,
    *,
    wait_for_all: bool = False,
) -> tuple[int, tuple[str, ...] | None]:
    """Probe the failed attempt's members; return the next (attempt, members), or members None.

    A reply showing a later attempt is adopted as is (None if this member is not in it); otherwise the
    next attempt is made of the members that answered and are still in the round. With `wait_for_all`,
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
        for member, reply in zip(others, replies, strict=True):
            if isinstance(reply, asyncio.CancelledError):
                raise reply
            if isinstance(reply, BaseException):
                logger.debug("probe of %s failed: %r", member, reply)
                continue
            status = reply.message
            if status.alive and not status.done:
                alive.add(member)
                if status.attempt > failed and (ahead is None or status.attempt > ahead.attempt):
                    ahead = status
            elif status.behind:
                behind.add(member)
        if ahead is not None:
            if me not in ahead.members:
                return ahead.attempt, None
            return ahead.attempt, tuple(ahead.members)
        if not (wait_for_all and behind and time.monotonic() + 2 * _BEHIND_POLL_S < deadline):
            return failed + 1, tuple(m for m in session.members if m in alive)
        if not logged:
            logger.info("ring %s round %d: waiting for %s, behind", session.ring_id, session.round, behind)
            logged = True
        await asyncio.sleep(_BEHIND_POLL_S)
