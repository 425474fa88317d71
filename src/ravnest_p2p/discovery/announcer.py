"""Keep this peer's record alive in the DHT: refresh at a third of its TTL, say `draining` on the way out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ravnest_p2p.discovery.dht import RunDHT, dht_time
from ravnest_p2p.discovery.records import PeerRecord
from ravnest_p2p.types import PeerState

__all__ = ["Announcer"]

logger = logging.getLogger(__name__)

PEERS_KEY = "peers"


class Announcer:
    """Publishes `make_record()` under ``peers`` every ``ttl_s / 3`` seconds until closed."""

    def __init__(self, dht: RunDHT, make_record: Callable[[], PeerRecord], *, ttl_s: float = 45.0) -> None:
        if ttl_s <= 1:
            raise ValueError("ttl_s must be over a second")
        self._dht = dht
        self._make_record = make_record
        self.ttl_s = ttl_s
        self._wake = asyncio.Event()
        self.num_published = 0
        self._expires_at = 0.0  # expiry of the last record we stored

    def refresh_soon(self) -> None:
        """Publish now rather than at the next period (e.g. after a measurement or state change)."""
        self._wake.set()

    async def publish_once(self, *, state: PeerState | None = None, ttl_s: float | None = None) -> bool:
        record = self._make_record()
        if state is not None:
            record = record.model_copy(update={"state": state})
        ttl_s = ttl_s or self.ttl_s
        ok = await self._dht.store_own(
            PEERS_KEY, record.model_dump(mode="json"), ttl_s=ttl_s, pin_to_initial_peers=True
        )
        if ok:
            self.num_published += 1
            self._expires_at = max(self._expires_at, dht_time() + ttl_s)
        else:
            logger.warning("no DHT replica accepted our record; will retry")
        return ok

    async def run(self) -> None:
        period_s = self.ttl_s / 3
        while True:
            try:
                ok = await self.publish_once()
            except Exception as exc:  # a DHT hiccup must not end announcing
                logger.warning("announcing failed: %r", exc)
                ok = False
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), period_s if ok else min(2.0, period_s))
            except TimeoutError:
                pass

    async def drain(self, *, linger_s: float = 5.0) -> None:
        """Announce `draining`, so others stop planning around us quickly.

        A DHT replica keeps a subkey's value only for a later expiry, so the draining record expires
        `linger_s` from now or just after our last record, whichever is later (a shorter one was refused
        by every replica: peers saw us as active until our last record expired).
        """
        ttl_s = max(linger_s, self._expires_at - dht_time() + 0.01)
        try:
            await asyncio.wait_for(self.publish_once(state=PeerState.DRAINING, ttl_s=ttl_s), 5.0)
        except Exception as exc:
            logger.info("could not announce draining: %r", exc)
