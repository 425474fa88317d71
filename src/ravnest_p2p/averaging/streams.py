"""Raw byte streams between peers for the ring: over hivemind's libp2p daemon, or in memory for tests.

The ring's data plane does not go through the typed RPC (see `frames.py` for why); it needs only
"open a stream to a peer under a protocol name" and "serve a protocol name". `P2PStreams` gives that
over hivemind's binary stream handlers (libp2p multiplexes streams over the one connection between two
daemons); `MemoryStreamHub` gives it over a `FakeNetwork`, keeping the parts of the contract that the
ring depends on: a killed peer's streams break, a reader that does not read stalls its writer once a
bounded buffer is full, and `network.delay_s` slows every write.

Both give the writer of an opened stream as a `BackgroundWriter` when the peer has a `TrafficGate`
(always over the daemon: the transport's gate): the part sender finds the gate there and yields to the
pipeline's sends (see `transport/priority.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from hivemind.p2p import P2PDaemonError, P2PHandlerError, PeerID

from ravnest_p2p.averaging.frames import ByteReader, ByteWriter, write_error
from ravnest_p2p.errors import PeerUnreachable
from ravnest_p2p.transport import FakeNetwork, P2PTransport
from ravnest_p2p.transport.priority import TrafficGate

__all__ = ["BackgroundWriter", "MemoryStreamHub", "MemoryStreams", "P2PStreams", "StreamHandler", "Streams"]

logger = logging.getLogger(__name__)

StreamHandler = Callable[[str, ByteReader, ByteWriter], Coroutine[Any, Any, None]]
"""Called with (remote peer id, reader, writer) for each incoming stream; closes the writer when done."""


class Streams(Protocol):
    async def serve(self, name: str, handler: StreamHandler) -> None: ...

    async def unserve(self, name: str) -> None: ...

    async def open(self, peer_id: str, name: str) -> tuple[ByteReader, ByteWriter]:
        """Open a stream to `peer_id`'s handler `name`.

        Raises:
            PeerUnreachable: the peer cannot be dialled or does not serve `name`.
        """
        ...

    def foreground_recent(self) -> bool:
        """Whether this peer's foreground (pipeline) traffic is sending, or sent a moment ago."""
        ...


class BackgroundWriter:
    """A stream's writer whose bytes are background traffic of `gate`: call `turn()` before each part.

    It measures how long its parts keep the link busy (the time `drain` waits, plus what the user adds to
    `busy_s`, e.g. waiting for acknowledgements), which sets how long the next turn may yield.
    """

    def __init__(self, writer: ByteWriter, gate: TrafficGate) -> None:
        self._writer = writer
        self.gate = gate
        self.busy_s = 0.0

    async def turn(self) -> None:
        await self.gate.background_turn(self.busy_s)
        self.busy_s = 0.0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        started = time.monotonic()
        try:
            await self._writer.drain()
        finally:
            self.busy_s += time.monotonic() - started

    def close(self) -> None:
        self._writer.close()


class P2PStreams:
    """Streams over the daemon of a `P2PTransport`; what they send is background traffic."""

    def __init__(self, transport: P2PTransport) -> None:
        self._transport = transport

    async def serve(self, name: str, handler: StreamHandler) -> None:
        # each stream takes a slot of its sender's inbound budget (`transport/budget.py`): over it, the
        # stream is refused before its hello is read
        async def on_stream(
            remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lease: Any
        ) -> None:
            await handler(remote, reader, writer)

        async def refuse(writer: asyncio.StreamWriter, reason: str) -> None:
            write_error(writer, "busy", reason)  # in the ring's framing: the sender's ack reader parses it
            await writer.drain()

        await self._transport.add_stream_handler(name, on_stream, refuse=refuse)

    async def unserve(self, name: str) -> None:
        await self._transport.remove_stream_handler(name)

    async def open(self, peer_id: str, name: str) -> tuple[ByteReader, ByteWriter]:
        # The daemon cannot route to a peer it never dialled: dial by the multiaddrs the transport knows.
        await self._transport.ensure_connected(peer_id)
        try:
            _, reader, writer = await self._transport.p2p.call_binary_stream_handler(
                PeerID.from_base58(peer_id), name
            )
        except (P2PDaemonError, P2PHandlerError, ConnectionError, ValueError) as exc:
            raise PeerUnreachable(f"cannot open {name} to {peer_id}: {type(exc).__name__}: {exc}") from None
        return reader, BackgroundWriter(writer, self._transport.gate)

    def foreground_recent(self) -> bool:
        return self._transport.gate.foreground_recent()


# ----- in memory ---------------------------------------------------------------------------------


class _Pipe:
    """One direction of an in-memory stream: a bounded byte buffer between two peers of a network."""

    def __init__(self, hub: MemoryStreamHub, src: str, dst: str) -> None:
        self._hub, self._src, self._dst = hub, src, dst
        self._buffer = bytearray()
        self._closed = False
        self._changed = asyncio.Event()

    def _check_alive(self) -> None:
        if not (self._hub.alive(self._src) and self._hub.alive(self._dst)):
            raise ConnectionResetError(f"{self._src} or {self._dst} is gone")

    async def _wait_change(self) -> None:
        # a fake peer dies by vanishing from the network (no callback): look again every few ms
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.02):  # not wait_for: on 3.11 it can swallow a cancellation
                await self._changed.wait()
        self._changed.clear()

    def _notify(self) -> None:
        self._changed.set()

    # reader side
    async def read(self, n: int = -1) -> bytes:
        while not self._buffer:
            self._check_alive()
            if self._closed:
                return b""
            await self._wait_change()
        self._check_alive()
        n = len(self._buffer) if n < 0 else min(n, len(self._buffer))
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        self._notify()
        return out

    async def readexactly(self, n: int) -> bytes:
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = await self.read(n - got)
            if not chunk:
                raise asyncio.IncompleteReadError(b"".join(parts), n)
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    # writer side
    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._check_alive()
        if self._closed:
            raise ConnectionResetError("write to a closed stream")
        self._buffer += memoryview(data).cast("B")
        self._notify()

    async def drain(self) -> None:
        if self._hub.network.delay_s:
            await asyncio.sleep(self._hub.network.delay_s)
        while len(self._buffer) > self._hub.capacity_bytes:
            self._check_alive()
            if self._closed:
                raise ConnectionResetError("stream closed")
            await self._wait_change()
        self._check_alive()

    def close(self) -> None:
        self._closed = True
        self._notify()


class _End:
    """A stream end: reads one pipe, writes the other; closing it closes both directions."""

    def __init__(self, inbound: _Pipe, outbound: _Pipe) -> None:
        self._in, self._out = inbound, outbound

    async def read(self, n: int = -1) -> bytes:
        return await self._in.read(n)

    async def readexactly(self, n: int) -> bytes:
        return await self._in.readexactly(n)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._out.write(data)

    async def drain(self) -> None:
        await self._out.drain()

    def close(self) -> None:
        self._out.close()
        self._in.close()


class MemoryStreamHub:
    """In-memory streams among the peers of a `FakeNetwork` (a peer is alive while the network has it).

    Args:
        network: the fake network whose `kill` and `delay_s` the streams follow.
        capacity_bytes: bytes a stream buffers before its writer's `drain` waits.
    """

    def __init__(self, network: FakeNetwork, *, capacity_bytes: int = 256 << 10) -> None:
        self.network = network
        self.capacity_bytes = capacity_bytes
        self._handlers: dict[tuple[str, str], StreamHandler] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def alive(self, peer_id: str) -> bool:
        try:
            self.network.lookup(peer_id)
        except PeerUnreachable:
            return False
        return True

    def streams(self, peer_id: str, *, gate: TrafficGate | None = None) -> MemoryStreams:
        """`peer_id`'s streams; with `gate`, what it sends through them is that gate's background."""
        return MemoryStreams(self, peer_id, gate)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _open(self, src: str, dst: str, name: str) -> _End:
        if not self.alive(src) or not self.alive(dst):
            raise PeerUnreachable(f"{dst} is not on the fake network")
        handler = self._handlers.get((dst, name))
        if handler is None:
            raise PeerUnreachable(f"{dst} does not serve {name}")
        forward, backward = _Pipe(self, src, dst), _Pipe(self, dst, src)
        server_end = _End(forward, backward)
        task = asyncio.get_running_loop().create_task(handler(src, server_end, server_end))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return _End(backward, forward)


class MemoryStreams:
    """One peer's view of a `MemoryStreamHub`."""

    def __init__(self, hub: MemoryStreamHub, peer_id: str, gate: TrafficGate | None = None) -> None:
        self._hub = hub
        self._peer_id = peer_id
        self._gate = gate

    async def serve(self, name: str, handler: StreamHandler) -> None:
        self._hub._handlers[(self._peer_id, name)] = handler

    async def unserve(self, name: str) -> None:
        self._hub._handlers.pop((self._peer_id, name), None)

    async def open(self, peer_id: str, name: str) -> tuple[ByteReader, ByteWriter]:
        end = self._hub._open(self._peer_id, peer_id, name)
        return end, (end if self._gate is None else BackgroundWriter(end, self._gate))

    def foreground_recent(self) -> bool:
        return self._gate is not None and self._gate.foreground_recent()
