"""Suspect reports: how members learn fast that a peer of the plan died, without trusting one another.

Problem. A member that dies keeps its signed `PeerRecord` in the DHT until the record's TTL runs out,
and membership opens a new epoch only ``grace_s`` after that: tens of seconds in which the pipeline it
served is stuck. The stage next to it knows within seconds (`runtime.liveness` -> `NeighbourLost`).

Protocol. Whoever suspects a peer calls `MembershipService.report_suspect`. The service never excludes
on anybody's word, its own caller's included: it pings the suspect itself (`member_ping`, one call
under ``call_timeout_s``) and only if that fails excludes the peer for ``exclude_for_s`` and opens a new
epoch when the peer is a member of the active plan. It then publishes a `SuspectReport` (its list of
current suspects) under its own signed subkey of ``suspects`` and advertises the report's version in
its gossip; a member that sees a version it has not read reads the reports, pings each new suspect
itself, and excludes it on the same evidence. Members that all see the peer dead exclude it and,
being in the same active epoch, open the same next epoch, so their views and the next plan agree
within a few gossip rounds.

Misbehaviour is different: an alive peer that keeps sending refused messages answers pings. The
witness (the stage whose `PeerLedger` excluded it) excludes it on its own evidence
(`report_misbehaviour`) and reports it with kind ``misbehaving``; another member accepts such a report
without a ping only from a witness that could have seen it (the suspect's pipeline neighbour in the
active plan), at most one per reporter per epoch.

Limits: a lying member can get each of its own plan neighbours excluded once per epoch; it stays in
the plan itself, so it is the next witness's turn. Reports reach the others as fast as gossip
spreads the version (a few rounds), then one DHT read each.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ravnest_p2p.discovery import RunDHT
from ravnest_p2p.membership.gossip import PeerIdText
from ravnest_p2p.transport import RpcMethod

__all__ = [
    "MEMBER_PING",
    "SUSPECTS_KEY",
    "DhtSuspectBoard",
    "MemberPing",
    "MemorySuspectBoard",
    "Suspect",
    "SuspectBoard",
    "SuspectKind",
    "SuspectReport",
]

logger = logging.getLogger(__name__)

SUSPECTS_KEY = "suspects"
SCHEMA_VERSION = 1
MAX_SUSPECTS = 32


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)


class SuspectKind(StrEnum):
    UNREACHABLE = "unreachable"  # the reporter's own ping failed
    MISBEHAVING = "misbehaving"  # the reporter's ledger excluded it (a witness's evidence)


class Suspect(_Msg):
    peer_id: PeerIdText
    kind: SuspectKind
    reason: Annotated[str, StringConstraints(max_length=200)] = ""
    epoch: int = Field(ge=0, le=2**62)
    reported_at: float = Field(ge=0, le=1e12)


class SuspectReport(_Msg):
    """A member's current suspects, stored under its own signed subkey of ``suspects``."""

    schema_version: int = Field(default=SCHEMA_VERSION, ge=1, le=1000)
    suspects: tuple[Suspect, ...] = Field(default=(), max_length=MAX_SUSPECTS)


class MemberPing(_Msg):
    epoch: int = Field(default=0, ge=0, le=2**62)


# answered by every running membership service: "are you alive?" asked before excluding anyone
MEMBER_PING = RpcMethod(
    "member_ping", MemberPing, MemberPing, max_request_bytes=1024, max_tensors=0, handler_timeout_s=2.0
)


class SuspectBoard(Protocol):
    async def publish(self, report: SuspectReport, *, ttl_s: float) -> bool: ...

    async def read(self) -> dict[str, SuspectReport]:
        """Valid reports by signer peer id."""
        ...


def parse_report(value: Any) -> SuspectReport | None:
    """A valid report of our schema version, or None (logged at DEBUG)."""
    if not isinstance(value, dict) or value.get("schema_version") != SCHEMA_VERSION:
        return None
    try:
        return SuspectReport.model_validate(value)
    except ValidationError as exc:
        logger.debug("dropped a suspect report: %s", exc.errors()[0]["msg"])
        return None


class DhtSuspectBoard:
    """Reports under ``ravnest/<run>/suspects``, one signed subkey per reporter."""

    def __init__(self, dht: RunDHT) -> None:
        self._dht = dht

    async def publish(self, report: SuspectReport, *, ttl_s: float) -> bool:
        return await self._dht.store_own(SUSPECTS_KEY, report.model_dump(mode="json"), ttl_s=ttl_s)

    async def read(self) -> dict[str, SuspectReport]:
        raw = await self._dht.get_signed(SUSPECTS_KEY)
        reports = {pid: parse_report(value) for pid, (value, _expiry) in raw.items()}
        return {pid: r for pid, r in reports.items() if r is not None}


class MemorySuspectBoard:
    """A shared in-memory board for tests; ``view_as(peer_id)`` gives a writer."""

    def __init__(self) -> None:
        self.reports: dict[str, dict[str, Any]] = {}

    def view_as(self, peer_id: str) -> _MemoryWriter:
        return _MemoryWriter(self, peer_id)


class _MemoryWriter:
    def __init__(self, board: MemorySuspectBoard, peer_id: str) -> None:
        self._board = board
        self._peer_id = peer_id

    async def publish(self, report: SuspectReport, *, ttl_s: float) -> bool:
        self._board.reports[self._peer_id] = report.model_dump(mode="json")
        return True

    async def read(self) -> dict[str, SuspectReport]:
        reports = {pid: parse_report(value) for pid, value in self._board.reports.items()}
        return {pid: r for pid, r in reports.items() if r is not None}
