"""Real peers and a hostile stranger for the wire tests: hosts, raw streams, RSS, polling."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import psutil
from hivemind.p2p import PeerID

from ravnest_p2p.transport import HostConfig, P2PTransport, WireLimits, load_or_create_identity

FRAME_LEN = struct.Struct("!Q")


def rss_bytes() -> int:
    return int(psutil.Process(os.getpid()).memory_info().rss)


@contextlib.asynccontextmanager
async def hosts(n: int, *, limits: Sequence[WireLimits | None] = ()) -> AsyncIterator[list[P2PTransport]]:
    """`n` loopback hosts that know each other's addresses (host i with `limits[i]` if given)."""
    configs = [
        HostConfig(check_identity_free=False, **({"limits": lim} if lim is not None else {}))
        for lim in [*limits, *([None] * (n - len(limits)))]
    ]
    created: list[P2PTransport] = []
    try:
        created.extend(
            await asyncio.gather(*(P2PTransport.create(c, load_or_create_identity(None)) for c in configs))
        )
        maddrs = {t.peer_id: await t.visible_maddrs() for t in created}
        for t in created:
            for peer_id, addrs in maddrs.items():
                if peer_id != t.peer_id:
                    t.add_addresses(peer_id, addrs)
        yield created
    finally:
        await asyncio.wait_for(asyncio.gather(*(t.aclose() for t in created), return_exceptions=True), 30)


async def open_raw(
    attacker: P2PTransport, target: str, name: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw libp2p stream from `attacker` to `target`'s handler `name` (no framing of ours)."""
    await attacker.ensure_connected(target)
    _, reader, writer = await attacker.p2p.call_binary_stream_handler(PeerID.from_base58(target), name)
    return reader, writer


async def until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """Whether the other side closes the stream within `timeout_s` (whatever it wrote first)."""
    try:
        async with asyncio.timeout(timeout_s):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except (ConnectionError, OSError):
        return True
    return True


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


def close_all(writers: Sequence[asyncio.StreamWriter]) -> None:
    for writer in writers:
        with contextlib.suppress(Exception):
            writer.close()
