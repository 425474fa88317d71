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
    attempt's number and members (None: this member is out of the round). `late`: the holders hold
    the mean of a later attempt made without this member (`adopt_late`)."""

    attempt: int
    members: tuple[str, ...] | None
    holders: tuple[str, ...] = ()
    late: bool = False


async def reform(
    endpoint: RpcEndpoint,
    session: RingSession,
    config: RingConfig,
    deadline: float,
    *,
    wait_for_all: bool = False,
    adopt_late: bool = False,
) -> NextAttempt:
    """Probe the failed attempt's members; return who holds its mean, or the next attempt.

    Members that hold the failed attempt's whole mean (same members: the attempt committed, `commit.py`)
    win over everything else. Otherwise a reply showing a later attempt is adopted as is (members None
    if this member is not in it); otherwise the next attempt is made of the members that answered and
    are still in the round. With `wait_for_all`,
    members that answer that they are behind (alive, in this epoch's ring, not in this round yet) are
    probed again every `_BEHIND_POLL_S` until they arrive or the round deadline is near; they are left
    out only then. Waiting uses no attempt: `max_attempts` counts failures, not late members.

    With `adopt_late`, a member the others left out (it was late: they formed a later attempt without
    it) waits, re-probing every `_BEHIND_POLL_S`, until one of them holds that attempt's whole mean,
    and returns those holders (`late`); it gives up if that attempt fails too or the deadline nears.
    """
    me = endpoint.peer_id
    ring = set(session.ring or session.members)
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
        committed: dict[tuple[int, tuple[str, ...]], list[str]] = {}  # attempts made without me
        for member, reply in zip(others, replies, strict=True):
            if isinstance(reply, asyncio.CancelledError):
                raise reply
            if isinstance(reply, BaseException):
                logger.debug("probe of %s failed: %r", member, reply)
                continue
            status = reply.message
            if status.holds == failed and tuple(status.members) == session.members:
                holders.append(member)
            elif adopt_late and status.holds > failed and _without(me, status.members, ring):
                committed.setdefault((status.holds, tuple(status.members)), []).append(member)
            if status.alive and not status.done:
                alive.add(member)
                if status.attempt > failed and (ahead is None or status.attempt > ahead.attempt):
                    ahead = status
            elif status.behind:
                behind.add(member)
        if holders:
            return NextAttempt(failed, session.members, tuple(holders))
        if committed:  # the latest attempt that committed without me
            (attempt, members), who = max(committed.items())
            return NextAttempt(attempt, members, tuple(who), late=True)
        waits = time.monotonic() + 2 * _BEHIND_POLL_S < deadline
        if ahead is not None and me in ahead.members:
            return NextAttempt(ahead.attempt, tuple(ahead.members))
        if ahead is not None and not (adopt_late and waits):
            return NextAttempt(ahead.attempt, None)
        if ahead is not None:  # running without me: its mean is what the others will apply
            if not logged:
                logger.info(
                    "ring %s round %d: left out, waiting for attempt %d's mean",
                    session.ring_id,
                    session.round,
                    ahead.attempt,
                )
                logged = True
            await asyncio.sleep(_BEHIND_POLL_S)
            continue
        if not (wait_for_all and behind and waits):
            return NextAttempt(failed + 1, tuple(m for m in session.members if m in alive))
        if not logged:
            logger.info("ring %s round %d: waiting for %s, behind", session.ring_id, session.round, behind)
            logged = True
        await asyncio.sleep(_BEHIND_POLL_S)


def _without(me: str, members: list[str], ring: set[str]) -> bool:
    """Whether `members` is an attempt of this ring made without `me` (one a late member may adopt)."""
    return me not in members and len(members) >= 2 and set(members) <= ring
