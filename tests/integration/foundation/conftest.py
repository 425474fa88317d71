"""A swarm of real peers (real p2pd, loopback, port 0) in this test's event loop."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ravnest_p2p.measurement import ProbeConfig
from ravnest_p2p.node import Peer, PeerConfig

FAST = {
    "record_ttl_s": 8.0,
    "directory_refresh_s": 0.5,
    "check_identity_free": False,
    "probe": ProbeConfig(period_s=5.0, initial_probe_bytes=64 * 1024, max_probe_bytes=256 * 1024),
}


async def start_swarm(n: int, run_id: str, **overrides) -> list[Peer]:
    """Bootstrap one peer, then join the rest through it (concurrently); all closed by the caller."""
    first = await Peer.start(PeerConfig(run_id=run_id, **{**FAST, **overrides}))
    cfg = PeerConfig(run_id=run_id, initial_peers=tuple(first.maddrs), **{**FAST, **overrides})
    results = await asyncio.gather(*(Peer.start(cfg) for _ in range(n - 1)), return_exceptions=True)
    peers = [first] + [r for r in results if isinstance(r, Peer)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(peers)
        raise errors[0]
    return peers


async def close_all(peers: list[Peer]) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.gather(*(p.aclose() for p in peers), return_exceptions=True), 60)


@pytest.fixture
async def make_swarm():
    created: list[Peer] = []

    async def factory(n: int, run_id: str = "it", **overrides) -> list[Peer]:
        peers = await start_swarm(n, run_id, **overrides)
        created.extend(peers)
        return peers

    yield factory
    await close_all(created)
