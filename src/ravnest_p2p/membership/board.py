"""Where peers publish the digest of the plan they computed: ``plan/<epoch>`` in the DHT, or a fake.

Each peer writes only its own signed subkey (hivemind's `RSASignatureValidator` via `RunDHT`), so a
digest under a peer's subkey is that peer's word. Values that are not a 64-hex string are ignored.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from ravnest_p2p.discovery import RunDHT

__all__ = ["DhtPlanBoard", "MemoryPlanBoard", "PlanBoard", "plan_key"]

_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def plan_key(epoch: int) -> str:
    return f"plan/{epoch}"


class PlanBoard(Protocol):
    async def publish(self, epoch: int, digest: str, *, ttl_s: float) -> bool: ...

    async def read(self, epoch: int) -> dict[str, str]:
        """Digests published for ``epoch`` as {signer peer id: digest}."""
        ...


def _valid_digests(raw: dict[str, Any]) -> dict[str, str]:
    return {pid: v for pid, v in raw.items() if isinstance(v, str) and _DIGEST_RE.match(v)}


class DhtPlanBoard:
    def __init__(self, dht: RunDHT) -> None:
        self._dht = dht

    async def publish(self, epoch: int, digest: str, *, ttl_s: float) -> bool:
        return await self._dht.store_own(plan_key(epoch), digest, ttl_s=ttl_s)

    async def read(self, epoch: int) -> dict[str, str]:
        raw = await self._dht.get_signed(plan_key(epoch))
        return _valid_digests({pid: value for pid, (value, _expiry) in raw.items()})


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
        return _valid_digests(dict(self._board.digests.get(epoch, {})))
