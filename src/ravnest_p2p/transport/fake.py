"""An in-memory transport for unit tests: peers in one `FakeNetwork`, calls are direct coroutine calls.

It keeps the parts of the real transport's contract that logic depends on: limits are enforced, a
missing peer or handler is `PeerUnreachable`, and a peer can be taken down (`network.kill(peer_id)`) or
made slow (`network.delay_s`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from ravnest_p2p.errors import PeerUnreachable
from ravnest_p2p.transport.base import RawHandler
from ravnest_p2p.transport.priority import TrafficGate
from ravnest_p2p.transport.wire import error_envelope

__all__ = ["FakeNetwork", "FakeTransport"]


class FakeNetwork:
    def __init__(self, *, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self._peers: dict[str, FakeTransport] = {}
        self._ids = itertools.count()
        self.bytes_sent = 0

    def create(self, peer_id: str | None = None) -> FakeTransport:
        peer_id = peer_id or f"fake-{next(self._ids)}"
        transport = FakeTransport(self, peer_id)
        self._peers[peer_id] = transport
        return transport

    def kill(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)

    def lookup(self, peer_id: str) -> FakeTransport:
        try:
            return self._peers[peer_id]
        except KeyError:
            raise PeerUnreachable(f"no peer {peer_id} on the fake network") from None


class FakeTransport:
    def __init__(self, network: FakeNetwork, peer_id: str) -> None:
        self._network = network
        self._peer_id = peer_id
        self._handlers: dict[str, tuple[RawHandler, int]] = {}
        self.known_addresses: dict[str, list[str]] = {}
        self.gate = TrafficGate()

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def add_addresses(self, peer_id: str, maddrs: Sequence[str]) -> None:
        self.known_addresses[peer_id] = list(maddrs)

    async def ensure_connected(self, peer_id: str) -> None:
        """Nothing to dial in memory."""

    async def add_handler(self, name: str, handler: RawHandler, *, max_request_bytes: int) -> None:
        self._handlers[name] = (handler, max_request_bytes)

    async def remove_handler(self, name: str) -> None:
        self._handlers.pop(name, None)

    async def call(
        self,
        peer_id: str,
        name: str,
        data: bytes | Sequence[bytes | bytearray | memoryview],
        *,
        stream: bool,
        max_response_bytes: int,
    ) -> bytes:
        data = data if isinstance(data, bytes) else b"".join(data)
        target = self._network.lookup(peer_id)
        try:
            handler, max_request_bytes = target._handlers[name]
        except KeyError:
            raise PeerUnreachable(f"{peer_id} has no handler {name}") from None
        if self._network.delay_s:
            await asyncio.sleep(self._network.delay_s)
        self._network.bytes_sent += len(data)
        if len(data) > max_request_bytes:
            return error_envelope("payload_too_large", f"{len(data)} bytes")
        reply = await handler(data, self._peer_id)
        self._network.lookup(peer_id)  # a peer killed mid-call does not answer
        return reply

    async def aclose(self) -> None:
        self._network.kill(self._peer_id)
