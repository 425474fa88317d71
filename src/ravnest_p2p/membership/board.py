"""Where peers publish the digest of the plan they computed: the run's ``plan`` key in the DHT, or a fake.

Each peer writes only its own signed subkey (hivemind's `RSASignatureValidator` via `RunDHT`), so a
digest under a peer's subkey is that peer's word. The key name is fixed (``plan``; the DHT validator can
only check names it can enumerate): the value is a `PlanRecord` carrying the epoch, so each peer holds
one digest, for the epoch it is on. Values that fail `PlanRecord` (e.g. a digest that is not 64 hex
characters) are refused by the validator and ignored by readers.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from pydantic import Field, StringConstraints

from ravnest_p2p.discovery import RunDHT, dht_time
from ravnest_p2p.types import WireModel

__all__ = ["PLAN_KEY", "DhtPlanBoard", "MemoryPlanBoard", "PlanBoard", "PlanRecord", "parse_plan"]

PLAN_KEY = "plan"

Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class PlanRecord(WireModel):
    """One peer's word on the plan of one epoch."""

    schema_version: int = Field(default=1, ge=1, le=1)
    epoch: int = Field(ge=0, le=2**62)
    digest: Digest
    updated_at: float = Field(ge=0)


def parse_plan(value: Any, signer_peer_id: str = "") -> PlanRecord:
    """Validate an untrusted plan value (the DHT validator's schema for ``plan``); raises if bad."""
    return PlanRecord.model_validate(value)


class PlanBoard(Protocol):
    async def publish(self, epoch: int, digest: str, *, ttl_s: float) -> bool: ...

    async def read(self, epoch: int) -> dict[str, str]:
        """Digests published for ``epoch`` as {signer peer id: digest}."""
        ...


def _valid_records(raw: dict[str, Any]) -> dict[str, PlanRecord]:
    out = {}
    for pid, value in raw.items():
        try:
            out[pid] = parse_plan(value, pid)
        except ValueError:
            continue
    return out


class DhtPlanBoard:
    def __init__(self, dht: RunDHT) -> None:
        self._dht = dht

    async def publish(self, epoch: int, digest: str, *, ttl_s: float) -> bool:
        record = PlanRecord(epoch=epoch, digest=digest, updated_at=dht_time())
        return await self._dht.store_own(PLAN_KEY, record.model_dump(mode="json"), ttl_s=ttl_s)

    async def read_all(self) -> dict[str, PlanRecord]:
        """Every peer's current plan record, by signer peer id (whatever its epoch)."""
        raw = await self._dht.get_signed(PLAN_KEY)
        return _valid_records({pid: value for pid, (value, _expiry) in raw.items()})

    async def read(self, epoch: int) -> dict[str, str]:
        return {pid: r.digest for pid, r in (await self.read_all()).items() if r.epoch == epoch}


class MemoryPlanBoard:
    """A shared in-memory board for tests and the simulator; ``view_as(peer_id)`` gives a writer."""

    def __init__(self) -> None:
        self.digests: dict[int, dict[str, str]] = {}

    def view_as(self, peer_id: str) -> _MemoryWriter:
        return _MemoryWriter(self, peer_id)


class _MemoryWriter:
    def __init__(self, board: MemoryPlanBoard, peer_id: str) -> None:
        self._board = board
        self._peer_id = peer_id

    async def publish(self, epoch: int, digest: str, *, ttl_s: float) -> bool:
        self._board.digests.setdefault(epoch, {})[self._peer_id] = digest
        return True

    async def read(self, epoch: int) -> dict[str, str]:
        raw = {
            pid: {"epoch": epoch, "digest": d, "updated_at": 0.0}
            for pid, d in self._board.digests.get(epoch, {}).items()
        }
        return {pid: r.digest for pid, r in _valid_records(raw).items()}
