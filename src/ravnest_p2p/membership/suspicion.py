"""The suspect-report state of one membership service (protocol and rules: `membership.suspects`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ravnest_p2p.errors import RemoteError, TransportError
from ravnest_p2p.membership.suspects import (
    MEMBER_PING,
    MemberPing,
    Suspect,
    SuspectBoard,
    SuspectKind,
    SuspectReport,
)
from ravnest_p2p.transport import CallContext, RpcEndpoint

__all__ = ["SuspicionKeeper"]

logger = logging.getLogger(__name__)


class SuspicionKeeper:
    """Verifies suspects by ping, excludes the dead ones, publishes and reads signed reports.

    Args:
        rpc: our endpoint (serves and calls `member_ping`).
        board: where reports are published and read (None: local verification only).
        call_timeout_s: deadline of a ping and of a board operation.
        report_ttl_s: how long a published report lives, and how long we keep a suspect in ours.
        exclude: ``exclude(peer_id, reason)`` — the service excludes it for the epoch.
        is_excluded: whether the service already excludes a peer.
        is_member: whether a peer is a live member (only members' reports are read).
        are_neighbours: whether two peers are adjacent stages of one cluster in the active plan.
        get_epoch: our current epoch.
        clock: DHT/wall time in seconds for ``reported_at`` (monotonic is per-host).
        read_period_s: least time between two reads of the board (a DHT search each).
        monotonic: the clock of ``read_period_s``.
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        board: SuspectBoard | None,
        *,
        call_timeout_s: float,
        report_ttl_s: float,
        exclude: Callable[[str, str], None],
        is_excluded: Callable[[str], bool],
        is_member: Callable[[str], bool],
        are_neighbours: Callable[[str, str], bool],
        get_epoch: Callable[[], int],
        clock: Callable[[], float],
        read_period_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rpc = rpc
        self.board = board
        self.call_timeout_s = call_timeout_s
        self.report_ttl_s = report_ttl_s
        self._exclude = exclude
        self._is_excluded = is_excluded
        self._is_member = is_member
        self._are_neighbours = are_neighbours
        self._get_epoch = get_epoch
        self._clock = clock
        self._pending: dict[str, tuple[str, SuspectKind, bool]] = {}  # peer -> (reason, kind, ours)
        self._ours: dict[str, Suspect] = {}
        self._dirty = False
        self._seen: set[tuple[str, str, float]] = set()
        self._witness_epoch: dict[str, int] = {}  # reporter -> epoch its misbehaviour report was taken
        self.read_period_s = read_period_s
        self._monotonic = monotonic
        self._read_at = -float("inf")
        self.wake = asyncio.Event()
        self.num_verified_dead = 0
        self.num_found_alive = 0

    async def serve(self) -> None:
        await self.rpc.serve(MEMBER_PING, self._on_ping)

    async def unserve(self) -> None:
        await self.rpc.unserve(MEMBER_PING)

    async def _on_ping(self, request: MemberPing, tensors: object, ctx: CallContext) -> MemberPing:
        return MemberPing(epoch=self._get_epoch())

    def report(self, peer_id: str, reason: str, *, kind: SuspectKind = SuspectKind.UNREACHABLE) -> None:
        """Our own suspicion: verified (unreachable) or taken as evidence (misbehaving) next round."""
        if peer_id == self.rpc.peer_id or self._is_excluded(peer_id):
            return
        self._pending[peer_id] = (reason[:200], kind, True)
        self.wake.set()

    async def step(self) -> None:
        """Read others' reports, settle pending suspects, publish ours if it changed."""
        await self._read()
        pending, self._pending = self._pending, {}
        to_ping = {}
        for peer_id, (reason, kind, ours) in pending.items():
            if self._is_excluded(peer_id):
                continue
            if kind == SuspectKind.MISBEHAVING:  # a witness's evidence: no ping can refute it
                self._confirm(peer_id, reason, kind, ours)
            else:
                to_ping[peer_id] = (reason, ours)
        alive = await asyncio.gather(*(self._ping(pid) for pid in to_ping))
        for (peer_id, (reason, ours)), answered in zip(to_ping.items(), alive, strict=True):
            if answered:
                self.num_found_alive += 1
                logger.info("suspect %s answered our ping: kept (%s)", peer_id, reason)
            else:
                self._confirm(peer_id, reason, SuspectKind.UNREACHABLE, ours)
        await self._publish()

    def _confirm(self, peer_id: str, reason: str, kind: SuspectKind, ours: bool) -> None:
        self.num_verified_dead += kind == SuspectKind.UNREACHABLE
        self._exclude(peer_id, f"{kind}: {reason}")
        if ours:
            now = self._clock()
            self._ours[peer_id] = Suspect(
                peer_id=peer_id, kind=kind, reason=reason, epoch=self._get_epoch(), reported_at=now
            )
            self._dirty = True

    async def _ping(self, peer_id: str) -> bool:
        try:
            await self.rpc.call(peer_id, MEMBER_PING, MemberPing(), timeout_s=self.call_timeout_s)
            return True
        except RemoteError:
            return True  # it answered
        except TransportError as exc:
            logger.info("suspect %s does not answer: %s", peer_id, exc)
            return False

    async def _read(self) -> None:
        now = self._monotonic()
        if self.board is None or now - self._read_at < self.read_period_s:
            return
        self._read_at = now
        try:
            reports = await asyncio.wait_for(self.board.read(), self.call_timeout_s)
        except (TimeoutError, OSError, TransportError) as exc:
            logger.debug("could not read suspect reports: %r", exc)
            return
        epoch = self._get_epoch()
        for reporter, report in reports.items():
            if reporter == self.rpc.peer_id or not self._is_member(reporter):
                continue  # strangers' reports are not even verified
            for suspect in report.suspects:
                key = (reporter, suspect.peer_id, suspect.reported_at)
                if key in self._seen or suspect.peer_id == self.rpc.peer_id:
                    continue
                self._seen.add(key)
                if self._is_excluded(suspect.peer_id) or suspect.peer_id in self._pending:
                    continue
                kind = SuspectKind.UNREACHABLE
                if (
                    suspect.kind == SuspectKind.MISBEHAVING
                    and self._are_neighbours(reporter, suspect.peer_id)
                    and self._witness_epoch.get(reporter) != epoch
                ):
                    self._witness_epoch[reporter] = epoch
                    kind = SuspectKind.MISBEHAVING
                why = f"reported by {reporter}: {suspect.reason}"
                self._pending[suspect.peer_id] = (why[:200], kind, False)

    async def _publish(self) -> None:
        now = self._clock()
        for pid in [p for p, s in self._ours.items() if now - s.reported_at > self.report_ttl_s]:
            del self._ours[pid]
            self._dirty = True
        if not self._dirty or self.board is None:
            return
        report = SuspectReport(suspects=tuple(sorted(self._ours.values(), key=lambda s: s.peer_id))[-32:])
        try:
            await asyncio.wait_for(self.board.publish(report, ttl_s=self.report_ttl_s), self.call_timeout_s)
            self._dirty = False
        except (TimeoutError, OSError, TransportError) as exc:
            logger.warning("could not publish suspect reports: %r", exc)
