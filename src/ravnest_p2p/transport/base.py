"""The transport seam: a bytes-in, bytes-out request/response interface between peers.

Two implementations: `p2p.P2PTransport` over hivemind's libp2p daemon, and `fake.FakeTransport`, an
in-memory double for unit tests (httpx's MockTransport idea). The typed RPC layer (`rpc.py`) is written
once against this protocol.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ravnest_p2p.transport.priority import TrafficGate
from ravnest_p2p.transport.wire import Buffer

__all__ = ["UNARY_LIMIT_BYTES", "RawHandler", "Transport"]

# hivemind's daemon caps unary messages at 4 MiB and a one-sided raise hangs; stay well below and stream
# anything larger.
UNARY_LIMIT_BYTES = 2 * 1024 * 1024

RawHandler = Callable[[Buffer, str], Awaitable[bytes]]
"""Called with (request bytes, caller's peer id); returns reply bytes. Must not raise."""


class Transport(Protocol):
    gate: TrafficGate
    """This peer's foreground/background priority, shared by its RPC endpoint and averaging streams."""

    @property
    def peer_id(self) -> str: ...

    async def add_handler(self, name: str, handler: RawHandler, *, max_request_bytes: int) -> None: ...

    async def remove_handler(self, name: str) -> None: ...

    async def call(
        self,
        peer_id: str,
        name: str,
        data: bytes | Sequence[bytes | bytearray | memoryview],
        *,
        stream: bool,
        max_response_bytes: int,
    ) -> Buffer:
        """Send a request (whole, or as pieces sent without joining them) and return the reply."""

    def add_addresses(self, peer_id: str, maddrs: Sequence[str]) -> None:
        """Remember where a peer listens, so a later call can dial it directly."""
        ...

    async def ensure_connected(self, peer_id: str) -> None:
        """Dial `peer_id` now by its remembered addresses (calls do this themselves when needed)."""
        ...
