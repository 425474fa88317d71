"""Telling a dead pipeline neighbour from a slow one, in seconds: heartbeats plus everything heard.

Problem. A stage whose neighbour died used to notice only when its window stayed shut for
``micro_batch_timeout_s`` (300 s, silent meanwhile): a micro-batch can legitimately take long (a slow
peer, a congested link), so that deadline must be generous, and it was the only signal.

Design. Liveness is "heard from it recently", not "got my micro-batch back". Every stage pings each
neighbour every ``heartbeat_period_s`` (`stage_ping`, a few bytes, answered on the event loop even
while the neighbour's compute thread is busy), and anything else received from or delivered to it
counts as hearing it too. A neighbour silent for ``neighbour_timeout_s`` is lost: the stage fails with
`NeighbourLost` naming it. A slow neighbour keeps answering pings, so it is never declared dead. A ping
reply also says whether the neighbour's own stage gave up and on whom, so a break anywhere in the chain
reaches the first stage within about one heartbeat per hop. A neighbour that answers with
``stale_epoch`` serves another plan: that counts as silence (one still finishing the previous plan is
not heard yet, so never lost; one that moved on after we heard it is lost after the timeout).

The clock of a neighbour starts at the first time we hear it: peers pick up a plan on their own
schedule, and one that has not started serving yet is the first stage's `wait_ready` concern, not a
death.

Alternatives rejected: a shorter micro-batch deadline (declares slow peers dead); relying on send
failures alone (a stage that is waiting, not sending, would never notice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from ravnest_p2p.errors import RemoteError, TransportError
from ravnest_p2p.runtime.epochs import EpochSwitch
from ravnest_p2p.runtime.messages import PING, PingReply, PingRequest
from ravnest_p2p.transport.rpc import Reply, RpcEndpoint

__all__ = ["NeighbourWatch"]

logger = logging.getLogger(__name__)


class NeighbourWatch:
    """Heartbeats to ``neighbours``; ``on_lost(peer_id, reason)`` once one falls silent or gives up.

    Args:
        rpc: our endpoint.
        epoch: the plan epoch pings name.
        neighbours: the peers whose liveness we need (previous and next stage).
        period_s: time between pings to one neighbour.
        timeout_s: silence after which a heard neighbour is lost.
        on_lost: called (possibly more than once; the caller keeps the first) with the suspect.
        epochs: the stage's `EpochSwitch` (None: always `epoch`); while a neighbour is not known to take
            the stage's new epoch, each heartbeat first probes it with the new epoch, then pings with the
            old one.
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        epoch: int,
        neighbours: Sequence[str],
        *,
        period_s: float,
        timeout_s: float,
        on_lost: Callable[[str, str], None],
        epochs: EpochSwitch | None = None,
    ) -> None:
        self.rpc = rpc
        self.epoch = epoch
        self.epochs = epochs  # during an in-place switch to a new plan: which epoch each neighbour takes
        self.neighbours = list(dict.fromkeys(neighbours))
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._on_lost = on_lost
        self.last_heard: dict[str, float] = {}
        self.num_pings = 0

    def heard(self, peer_id: str) -> None:
        """Something arrived from (or was accepted by) ``peer_id``: it is alive now."""
        if peer_id in self.neighbours:
            self.last_heard[peer_id] = time.monotonic()

    def silent_for(self, peer_id: str) -> float | None:
        heard = self.last_heard.get(peer_id)
        return None if heard is None else time.monotonic() - heard

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Watch every neighbour until ``stop`` is set (or cancelled)."""
        await asyncio.gather(*(self._watch(peer, stop or asyncio.Event()) for peer in self.neighbours))

    async def _watch(self, peer: str, stop: asyncio.Event) -> None:
        ping_timeout_s = max(0.1, min(2 * self.period_s, self.timeout_s / 2))
        while not stop.is_set():
            started = time.monotonic()
            try:
                reply = await self._ping(peer, ping_timeout_s)
                self.num_pings += 1
                self.heard(peer)
                if self._gave_up(peer, reply.message):
                    return
            except RemoteError as exc:
                # another epoch: not (yet, or any more) our neighbour; silent as far as we care, so a
                # neighbour still finishing the previous plan is waited for and one that moved on is lost
                if exc.code != "stale_epoch":
                    self.heard(peer)  # it answered
            except TransportError as exc:
                logger.debug("ping to %s failed: %s", peer, exc)
            silent_s = self.silent_for(peer)
            if silent_s is not None and silent_s > self.timeout_s:
                self._on_lost(peer, f"no answer for {silent_s:.1f}s")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, self.period_s - (time.monotonic() - started)))

    async def _ping(self, peer: str, timeout_s: float) -> Reply[PingReply]:
        epochs = self.epochs
        if epochs is None:
            return await self.rpc.call(
                peer, PING, PingRequest(epoch=self.epoch), timeout_s=timeout_s, foreground=False
            )
        newer = epochs.pending(peer)
        if newer is not None:
            try:
                reply = await self.rpc.call(
                    peer, PING, PingRequest(epoch=newer), timeout_s=timeout_s, foreground=False
                )
                epochs.heard(peer, newer)  # it switched too: from now on it gets the new epoch
                return reply
            except RemoteError as exc:
                if exc.code != "stale_epoch":
                    raise
        epoch = epochs.for_peer(peer)
        reply = await self.rpc.call(
            peer, PING, PingRequest(epoch=epoch), timeout_s=timeout_s, foreground=False
        )
        epochs.heard(peer, epoch)
        return reply

    def _gave_up(self, peer: str, reply: PingReply) -> bool:
        if reply.lost_peer_id:
            suspect = reply.lost_peer_id if reply.lost_peer_id != self.rpc.peer_id else peer
            self._on_lost(suspect, f"reported lost by {peer}")
            return True
        return False
