"""The live peer directory: every valid, unexpired record of the run, refreshed in the background.

Malformed, foreign-version, unsigned or mis-bound records are dropped and logged at DEBUG (a volunteer
has no use for them; a developer chasing a peer that never shows up does).
"""

from __future__ import annotations

import asyncio
import logging

from ravnest_p2p.discovery.announcer import PEERS_KEY
from ravnest_p2p.discovery.dht import RunDHT
from ravnest_p2p.discovery.records import PeerRecord, parse_peer_record
from ravnest_p2p.errors import InvalidRecord, TransportError
from ravnest_p2p.transport.base import Transport
from ravnest_p2p.types import PeerState

__all__ = ["PeerDirectory"]

logger = logging.getLogger(__name__)


class PeerDirectory:
    """Valid records by peer id; tells `transport` their addresses.

    With `dial_new_peers` (for DHT clients: the status tool, `RunClient`) every refresh also dials the
    peers it has not dialled yet, within `dial_timeout_s`: nobody dials a client, so without this its
    daemon cannot route DHT requests to anyone but its initial peers (see `discovery.dht`).
    """

    def __init__(
        self,
        dht: RunDHT,
        transport: Transport | None = None,
        *,
        refresh_period_s: float = 5.0,
        dial_new_peers: bool = False,
        dial_timeout_s: float = 5.0,
    ):
        self._dht = dht
        self._transport = transport
        self.refresh_period_s = refresh_period_s
        self._dial_new_peers = dial_new_peers
        self._dial_timeout_s = dial_timeout_s
        self._dialled: set[str] = set()
        self._peers: dict[str, PeerRecord] = {}
        self._expiry: dict[str, float] = {}
        self.num_dropped = 0

    @property
    def num_dialled(self) -> int:
        """Peers this directory has dialled (with `dial_new_peers`)."""
        return len(self._dialled)

    @property
    def peers(self) -> dict[str, PeerRecord]:
        """Last known live records by peer id (including draining ones; see `active`)."""
        return dict(self._peers)

    def active(self, *, exclude: str | None = None) -> dict[str, PeerRecord]:
        """Peers that are not draining, optionally without ourselves."""
        return {
            pid: rec for pid, rec in self._peers.items() if rec.state != PeerState.DRAINING and pid != exclude
        }

    async def refresh(self) -> dict[str, PeerRecord]:
        raw = await self._dht.get_signed(PEERS_KEY)
        peers: dict[str, PeerRecord] = {}
        expiry: dict[str, float] = {}
        for signer, (value, expiration) in raw.items():
            try:
                record = parse_peer_record(value, signer_peer_id=signer)
            except InvalidRecord as exc:
                self.num_dropped += 1
                logger.debug("dropped record signed by %s: %s", signer, exc)
                continue
            peers[signer] = record
            expiry[signer] = expiration
            if self._transport is not None and record.maddrs:
                self._transport.add_addresses(signer, record.maddrs)
        self._peers, self._expiry = peers, expiry
        if self._dial_new_peers:
            await self._dial([p for p, r in peers.items() if p not in self._dialled and r.maddrs])
        return dict(peers)

    async def _dial(self, peer_ids: list[str]) -> None:
        transport = self._transport
        if transport is None or not peer_ids:
            return

        async def dial(peer_id: str) -> None:
            try:
                async with asyncio.timeout(self._dial_timeout_s):
                    await transport.ensure_connected(peer_id)
                self._dialled.add(peer_id)
            except (TimeoutError, TransportError) as exc:
                logger.debug("cannot dial %s: %r", peer_id, exc)

        await asyncio.gather(*(dial(p) for p in peer_ids))

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:
                logger.warning("directory refresh failed: %r", exc)
            await asyncio.sleep(self.refresh_period_s)
