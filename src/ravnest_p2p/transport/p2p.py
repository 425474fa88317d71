"""The real transport: hivemind's in-loop `P2P` (a libp2p daemon child process) behind our seam.

Small requests go as unary calls over the daemon's persistent connection; requests above
`UNARY_LIMIT_BYTES`, and methods flagged as having large replies, go over a fresh libp2p stream with
length-prefixed frames (`wire.write_frame`). Every handler is registered on both paths.

Dialling: the daemon cannot route to a peer it has never been connected to ("routing: not found"), so
before the first call to a peer we connect to it by the multiaddrs from its record (`add_addresses`).
Two peers that dial each other at the same instant (the two members of a ring, whose rounds start on
the same wall-clock boundary) can both fail the handshake ("noise: message is too short"), after which
libp2p's dial backoff refuses every redial: seen on the lab as two ring members that never averaged
together. So a dial first asks the daemon whether a connection (perhaps the other side's) exists, the
peer with the larger id gives the smaller one `_DIAL_YIELD_S` to dial first, and a failed dial still
counts as connected when the other side's connection got through.

Inbound bounds (`limits.py`, `budget.py`): every inbound stream and unary call takes a slot of its
sender's budget, refused at once (``busy``) when the sender or everyone together holds too much; a
stream frame reserves its announced length before its body is read and is read as its bytes arrive,
under a frame deadline and an idle deadline, so a stream that stops sending is closed. Raw stream
handlers (`add_stream_handler`, the ring's part streams) take the same slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.utils.multiaddr import Multiaddr
from pydantic import BaseModel, ConfigDict, Field

from ravnest_p2p.errors import ConfigError, PayloadTooLarge, PeerUnreachable, TransportError
from ravnest_p2p.transport.base import UNARY_LIMIT_BYTES, RawHandler
from ravnest_p2p.transport.budget import InboundBudget, Lease
from ravnest_p2p.transport.daemon_guard import guard_pending_calls
from ravnest_p2p.transport.identity import Identity
from ravnest_p2p.transport.limits import WireLimits
from ravnest_p2p.transport.priority import TrafficGate
from ravnest_p2p.transport.wire import (
    Buffer,
    error_envelope,
    frame_size,
    read_frame,
    read_frame_body,
    read_frame_length,
    write_frame,
)
from ravnest_p2p.utils.aio import load_stretch

__all__ = ["HostConfig", "P2PTransport", "RawStreamHandler"]

RawStreamHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""Called with (remote peer id, reader, writer) for an admitted inbound stream; the writer is closed
after it returns."""

logger = logging.getLogger(__name__)

_STREAM_SUFFIX = "/stream"
_RECONNECT_AFTER_S = 30.0
_DIAL_YIELD_S = 0.5  # how long the larger peer id waits for the smaller one's dial (simultaneous open)
_DAEMON_CALL_S = 15.0  # a dial or a peer listing through the daemon's control socket, at most
_MAX_DISCARD_BYTES = 1 << 30  # a refused body an honest sender may still be writing (read, never kept)
_DISCARD_TIMEOUT_S = 10.0
_DISCARD_IDLE_S = 2.0  # a sender still writing its refused body sends something every moment
_REPLY_TIMEOUT_S = 10.0  # writing an error reply to a sender that does not read it


async def _linger(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Keep a replied stream open until the caller closes it (it does once it has read the reply).

    Closing first was seen to lose the end of a large reply (20 MiB, busy host): the daemon resets the
    libp2p stream when the handler's side closes, and the reset overtook bytes the caller's daemon had
    not yet delivered. The caller sends nothing after its request, so anything it does send is junk:
    it is read and dropped, and the wait is bounded by `timeout_s` either way.
    """
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout_s):
            while await reader.read(1 << 16):
                pass


class HostConfig(BaseModel):
    """How the libp2p host listens and joins. Defaults suit loopback tests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = False
    startup_timeout_s: float = Field(default=20.0, gt=0)
    check_identity_free: bool = True
    limits: WireLimits = WireLimits()


def _validate_maddrs(maddrs: Sequence[str], what: str) -> list[Multiaddr]:
    out = []
    for maddr in maddrs:
        try:
            out.append(Multiaddr(maddr))
        except Exception:
            raise ConfigError(f"{what}: {maddr!r} is not a valid multiaddr") from None
    return out


async def _discard(reader: asyncio.StreamReader, size_bytes: int) -> None:
    """Swallow a refused body (up to a bound, briefly) so an honest sender can read our error reply.

    Closing at once would reset the connection under a sender still writing, and it would see a reset
    instead of the reason. A hostile sender announcing terabytes just gets the connection closed.
    """
    if size_bytes > _MAX_DISCARD_BYTES:
        return
    with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        async with asyncio.timeout(_DISCARD_TIMEOUT_S):
            remaining = size_bytes
            while remaining > 0:
                async with asyncio.timeout(_DISCARD_IDLE_S):
                    chunk = await reader.read(min(remaining, 1 << 20))
                if not chunk:
                    return
                remaining -= len(chunk)


async def _reply_error(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(_REPLY_TIMEOUT_S):
            await write_frame(writer, error_envelope(code, message))


class P2PTransport:
    """A started libp2p host plus the raw request/response handlers registered on it."""

    def __init__(self, p2p: P2P, identity: Identity, limits: WireLimits | None = None) -> None:
        self._p2p = p2p
        self.identity = identity
        self.limits = limits or WireLimits()
        self.budget = InboundBudget(self.limits)
        self._addresses: dict[str, list[Multiaddr]] = {}
        self._connected_at: dict[str, float] = {}
        self._dial_locks: dict[str, asyncio.Lock] = {}
        self.gate = TrafficGate()  # pipeline sends first, averaging parts yield (see priority.py)

    @classmethod
    async def create(cls, config: HostConfig, identity: Identity) -> P2PTransport:
        initial = _validate_maddrs(config.initial_peers, "initial peer")
        hosts = _validate_maddrs(config.host_maddrs, "host multiaddr")
        announce = _validate_maddrs(config.announce_maddrs, "announce multiaddr")
        with tempfile.TemporaryDirectory(prefix="ravnest-id-") as tmp:
            if identity.path is not None:
                identity_path, check_free = str(identity.path), config.check_identity_free
            else:
                # ephemeral identity: p2pd reads its key from a file once, at start; the file goes right after
                identity_path, check_free = os.path.join(tmp, "identity.key"), False
                fd = os.open(identity_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
                with os.fdopen(fd, "wb") as f:
                    f.write(identity.to_file_bytes())
            p2p = await cls._start(config, initial, hosts, announce, identity_path, check_free)
        if p2p.peer_id.to_base58() != identity.peer_id:
            await p2p.shutdown()
            raise TransportError("p2p daemon started with a different identity than the one loaded")
        return cls(p2p, identity, config.limits)

    @staticmethod
    async def _start(
        config: HostConfig,
        initial: list[Multiaddr],
        hosts: list[Multiaddr],
        announce: list[Multiaddr],
        identity_path: str,
        check_free: bool,
    ) -> P2P:
        try:
            p2p = await P2P.create(
                initial_peers=initial or None,
                host_maddrs=hosts,
                announce_maddrs=announce or None,
                use_relay=config.use_relay,
                use_auto_relay=config.use_auto_relay,
                dht_mode="client" if config.client_mode else "server",
                # the daemon starts in ~1 s on an idle host, in over 20 s at a load of 45 on 2 cores
                startup_timeout=config.startup_timeout_s * load_stretch(),
                identity_path=identity_path,
                check_if_identity_free=check_free,
            )
        except P2PDaemonError as exc:
            raise TransportError(f"cannot start the p2p daemon: {exc}") from None
        guard_pending_calls(p2p)  # a late reply must not end the daemon client's reader (daemon_guard.py)
        return p2p

    @property
    def p2p(self) -> P2P:
        """The hivemind object, for the DHT adapter only."""
        return self._p2p

    @property
    def peer_id(self) -> str:
        return str(self._p2p.peer_id.to_base58())

    async def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<id>) under which others can reach this peer."""
        maddrs = await self._p2p.get_visible_maddrs(latest=True)
        return [str(m) for m in maddrs]

    def add_addresses(self, peer_id: str, maddrs: Sequence[str]) -> None:
        parsed = []
        for maddr in maddrs:
            with contextlib.suppress(Exception):
                m = Multiaddr(maddr)
                # strip a trailing /p2p/<id>: the daemon wants the transport part only
                parsed.append(m.decapsulate(Multiaddr(f"/p2p/{peer_id}")) if "p2p" in str(m) else m)
        if parsed:
            self._addresses[peer_id] = parsed

    async def ensure_connected(self, peer_id: str) -> None:
        """Dial `peer_id` by the addresses from `add_addresses` unless connected recently."""
        last = self._connected_at.get(peer_id)
        if last is not None and time.monotonic() - last < _RECONNECT_AFTER_S:
            return
        maddrs = self._addresses.get(peer_id)
        if not maddrs:
            return  # rely on the daemon's own routing (DHT peers are usually connected already)
        lock = self._dial_locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            if peer_id in self._connected_at and time.monotonic() - self._connected_at[peer_id] < 1.0:
                return
            if not await self._wait_for_connection(peer_id, 0.0 if self.peer_id < peer_id else _DIAL_YIELD_S):
                try:
                    async with asyncio.timeout(_DAEMON_CALL_S):
                        await self._p2p._client.connect(PeerID.from_base58(peer_id), maddrs)
                except (P2PDaemonError, TimeoutError) as exc:
                    if not await self._wait_for_connection(peer_id, 0.0):
                        raise PeerUnreachable(f"cannot dial {peer_id}: {exc!r}") from None
            self._connected_at[peer_id] = time.monotonic()

    async def _wait_for_connection(self, peer_id: str, timeout_s: float) -> bool:
        """Whether the daemon has a connection to `peer_id` (either side's), polling up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(P2PDaemonError, TimeoutError):
                async with asyncio.timeout(_DAEMON_CALL_S):
                    peers = await self._p2p.list_peers()
                if any(info.peer_id.to_base58() == peer_id for info in peers):
                    return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def add_handler(self, name: str, handler: RawHandler, *, max_request_bytes: int) -> None:
        budget = self.budget

        async def unary(request: BytesValue, context: P2PContext) -> BytesValue:
            remote = context.remote_id.to_base58()
            size = len(request.value)
            if size > max_request_bytes:
                return BytesValue(value=error_envelope("payload_too_large", f"{size} bytes"))
            lease = budget.admit(remote, size)
            if lease is None:
                return BytesValue(
                    value=error_envelope("busy", f"too many requests from {remote} in progress")
                )
            with lease:
                return BytesValue(value=await handler(request.value, remote))

        async def stream(
            remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lease: Lease
        ) -> None:
            limits = self.limits
            try:
                length = await read_frame_length(reader, timeout_s=limits.idle_timeout_s)
                if length > max_request_bytes:
                    await _reply_error(
                        writer, "payload_too_large", f"frame of {length} bytes exceeds {max_request_bytes}"
                    )
                    await _discard(reader, length)
                    return
                if not lease.reserve(length):
                    await _reply_error(writer, "busy", f"no room for {length} more bytes from {remote}")
                    return
                data = await read_frame_body(reader, length, limits=limits)
                reply = await handler(data, remote)
                del data
                if not lease.reserve(len(reply)):  # a reply waiting for a slow reader is held for it
                    reply = error_envelope("busy", f"no room for a reply of {len(reply)} bytes to {remote}")
                async with asyncio.timeout(limits.frame_timeout_s(len(reply))):
                    await write_frame(writer, reply)
                del reply
                await _linger(reader, limits.idle_timeout_s)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                logger.debug("stream %s from %s broke: %r", name, remote, exc)

        await self._p2p.add_protobuf_handler(name, unary, BytesValue)
        await self.add_stream_handler(name + _STREAM_SUFFIX, stream)

    async def add_stream_handler(
        self,
        name: str,
        handler: Callable[[str, asyncio.StreamReader, asyncio.StreamWriter, Lease], Awaitable[None]],
        *,
        refuse: Callable[[asyncio.StreamWriter, str], Awaitable[None]] | None = None,
    ) -> None:
        """Serve raw streams under `name`: each inbound stream takes a slot of its sender's budget.

        Over budget, the stream is closed unread after `refuse(writer, reason)` (default: a ``busy``
        error envelope in a frame) tells the sender why in the stream's own framing. `handler` gets the
        stream's `Lease` (to reserve the bytes it will hold) and must bound its own reads in time; the
        writer is closed and the lease released when it returns.
        """
        budget = self.budget

        async def default_refuse(writer: asyncio.StreamWriter, reason: str) -> None:
            await _reply_error(writer, "busy", reason)

        refusal = refuse or default_refuse

        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            remote = info.peer_id.to_base58()
            try:
                lease = budget.admit(remote)
                if lease is None:
                    logger.debug("refused a %s stream from %s: over budget", name, remote)
                    with contextlib.suppress(TimeoutError, ConnectionError):
                        async with asyncio.timeout(_REPLY_TIMEOUT_S):
                            await refusal(writer, f"too many streams from {remote}")
                    return
                with lease:
                    await handler(remote, reader, writer, lease)
            finally:
                writer.close()

        await self._p2p.add_binary_stream_handler(name, on_stream)

    async def remove_stream_handler(self, name: str) -> None:
        with contextlib.suppress(P2PDaemonError):
            await self._p2p.remove_binary_stream_handler(name)

    async def remove_handler(self, name: str) -> None:
        with contextlib.suppress(P2PDaemonError):
            await self._p2p.remove_protobuf_handler(name)
        with contextlib.suppress(P2PDaemonError):
            await self._p2p.remove_binary_stream_handler(name + _STREAM_SUFFIX)

    async def call(
        self,
        peer_id: str,
        name: str,
        data: bytes | Sequence[bytes | bytearray | memoryview],
        *,
        stream: bool,
        max_response_bytes: int,
    ) -> Buffer:
        await self.ensure_connected(peer_id)
        try:
            remote = PeerID.from_base58(peer_id)
        except Exception:
            raise PeerUnreachable(f"{peer_id!r} is not a peer id") from None
        try:
            if not stream and frame_size(data) <= UNARY_LIMIT_BYTES:
                whole = data if isinstance(data, bytes) else b"".join(data)
                reply = await self._p2p.call_protobuf_handler(
                    remote, name, BytesValue(value=whole), BytesValue
                )
                if len(reply.value) > max_response_bytes:
                    raise PayloadTooLarge(f"reply of {len(reply.value)} bytes exceeds {max_response_bytes}")
                return bytes(reply.value)
            _, reader, writer = await self._p2p.call_binary_stream_handler(remote, name + _STREAM_SUFFIX)
            try:
                with contextlib.suppress(ConnectionError):
                    # if the server refused early (oversized), its error reply is still readable below
                    await write_frame(writer, data)
                # the reply's first byte waits for the remote handler (the caller's deadline bounds
                # that); once it starts, it arrives under the frame and idle deadlines
                return await read_frame(reader, max_bytes=max_response_bytes, limits=self.limits)
            finally:
                writer.close()
        except (
            P2PDaemonError,
            P2PHandlerError,
            ConnectionError,
            asyncio.IncompleteReadError,
            TimeoutError,
        ) as exc:
            self._connected_at.pop(peer_id, None)
            notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))
            raise PeerUnreachable(
                f"call {name} to {peer_id} failed: {type(exc).__name__}: {exc}{notes}"
            ) from None

    async def aclose(self) -> None:
        await self._p2p.shutdown()
