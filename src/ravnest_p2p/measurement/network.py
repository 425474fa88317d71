"""How well this peer is connected: RTT pings and streamed bandwidth probes to a few peers, smoothed.

Each round the meter picks the `fanout` peers it has probed least recently, pings them, and times one
upload and one download of a probe payload. Within a probe the payload grows (up to `max_probe_bytes`)
until a transfer takes at least `min_transfer_s`, so a fast link is not mis-measured by per-call
overhead and a slow link is not flooded; the next probe of that peer starts at the size that sufficed.
Estimates are exponential moving averages per peer; the peer's advertised
figure is the best over peers (a slow remote end limits a probe, our own link never looks faster than it
is). Probes are bounded in size and in rate (`period_s`), and a server answers at most a couple at once,
so probing cannot crowd out training traffic.

Priority. The caller may name the peers the current plan depends on (pipeline neighbours, averaging
ring neighbours): their links enter the planner's matrix first. A round picks, in order: priority peers
not probed within `priority_refresh_s` (never probed first), then peers never probed, then the least
recently probed. The refresh bound keeps a plan's few neighbours from taking every round.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from ravnest_p2p.errors import InvalidMessage, TransportError
from ravnest_p2p.transport.limits import MAX_PROBE_BYTES
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint, RpcMethod

__all__ = ["LinkEstimate", "NetworkMeter", "ProbeConfig"]

logger = logging.getLogger(__name__)

MAX_REPORTED_MBPS = 100_000.0  # 100 Gbit/s: beyond any volunteer link; records refuse more than 400k
MAX_LATENCY_SHARE = 0.1  # of a probe transfer's time that may be discounted as the path's round trip


class PingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PingReply(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ProbeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    download_bytes: int = Field(ge=0, le=MAX_PROBE_BYTES)


class ProbeReply(BaseModel):
    model_config = ConfigDict(extra="ignore")
    received_bytes: int = Field(ge=0)


PING = RpcMethod("ping", PingRequest, PingReply, max_request_bytes=4096, handler_timeout_s=5)
PROBE = RpcMethod(
    "probe_bandwidth",
    ProbeRequest,
    ProbeReply,
    max_request_bytes=MAX_PROBE_BYTES + 65536,
    max_response_bytes=MAX_PROBE_BYTES + 65536,
    max_tensors=1,
    large_response=True,
    handler_timeout_s=60,
)


class ProbeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    period_s: float = Field(default=30.0, gt=0)
    fanout: int = Field(default=2, ge=1, le=16)
    initial_probe_bytes: int = Field(default=256 * 1024, ge=1024, le=MAX_PROBE_BYTES)
    max_probe_bytes: int = Field(default=MAX_PROBE_BYTES, ge=1024, le=MAX_PROBE_BYTES)
    min_transfer_s: float = Field(default=0.5, gt=0)
    ema_alpha: float = Field(default=0.3, gt=0, le=1)
    timeout_s: float = Field(default=20.0, gt=0)
    priority_refresh_s: float = Field(default=120.0, gt=0)


@dataclass
class LinkEstimate:
    rtt_ms: float | None = None
    min_rtt_ms: float | None = None
    upload_mbps: float | None = None
    download_mbps: float | None = None
    probe_bytes: int = 0
    last_probe_monotonic: float = 0.0
    num_probes: int = 0


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class NetworkMeter:
    """Serves `ping`/`probe_bandwidth` and probes other peers; owns per-peer `LinkEstimate`s."""

    def __init__(self, rpc: RpcEndpoint, config: ProbeConfig | None = None) -> None:
        self._rpc = rpc
        self.config = config or ProbeConfig()
        self.links: dict[str, LinkEstimate] = {}
        self._serving = asyncio.Semaphore(2)
        self.bytes_sent = 0

    async def serve(self) -> None:
        await self._rpc.serve(PING, self._on_ping)
        await self._rpc.serve(PROBE, self._on_probe)

    async def _on_ping(
        self, request: PingRequest, tensors: list[torch.Tensor], ctx: CallContext
    ) -> PingReply:
        return PingReply()

    async def _on_probe(
        self, request: ProbeRequest, tensors: list[torch.Tensor], ctx: CallContext
    ) -> tuple[ProbeReply, list[torch.Tensor]]:
        if len(tensors) > 1 or (tensors and tensors[0].dtype != torch.uint8):
            raise InvalidMessage("a probe carries at most one uint8 payload")
        async with self._serving:
            received = tensors[0].numel() if tensors else 0
            payload = (
                [torch.zeros(request.download_bytes, dtype=torch.uint8)] if request.download_bytes else []
            )
            return ProbeReply(received_bytes=received), payload

    async def ping(self, peer_id: str) -> float:
        start = time.perf_counter()
        await self._rpc.call(peer_id, PING, PingRequest(), timeout_s=self.config.timeout_s)
        return (time.perf_counter() - start) * 1000

    async def _timed_transfer(self, peer_id: str, size: int, *, upload: bool) -> float:
        """Seconds for one probe call moving ``size`` bytes up (to the peer) or down (from it)."""
        tensors = [torch.zeros(size, dtype=torch.uint8)] if upload else []
        request = ProbeRequest(download_bytes=0 if upload else size)
        start = time.perf_counter()
        await self._rpc.call(peer_id, PROBE, request, tensors=tensors, timeout_s=self.config.timeout_s)
        elapsed = time.perf_counter() - start
        if upload:
            self.bytes_sent += size
        return elapsed

    async def _measure(self, peer_id: str, size: int, base_s: float, *, upload: bool) -> tuple[float, int]:
        """(Mbit/s, payload size) of one direction, growing the payload until the transfer is long enough.

        The growth happens within this probe: a payload that was too short is worth nothing, and waiting
        for the next round (a full `period_s` later) to retry left fast links under-measured for minutes.
        The next size aims at 1.5x the target time from the rate just seen (2x-16x larger), so a fast
        link needs one or two retries, not a doubling ladder.

        Latency: one round trip of the call is not transfer, so ``base_s`` (the path's smallest RTT seen)
        is discounted, but never more than `MAX_LATENCY_SHARE` of the elapsed time, and a transfer must
        last `1 / MAX_LATENCY_SHARE` base RTTs (as well as `min_transfer_s`). A CPU-capped peer answers
        pings up to a quota period late, so its first base RTT can be 100-200 ms on a sub-ms link: taken
        whole, it inflated a 10 Mbit/s uplink to 12.6-13.5 Mbit/s in the lab. Capped, a true RTT still
        counts in full (the transfer is long enough) and a bogus one costs at most 11 %.
        """
        cfg = self.config
        target_s = max(cfg.min_transfer_s, base_s / MAX_LATENCY_SHARE)
        while True:
            elapsed = await self._timed_transfer(peer_id, size, upload=upload)
            logger.debug(
                "probe %s %s: %d bytes in %.3f s (base RTT %.1f ms)",
                "up to" if upload else "down from",
                peer_id,
                size,
                elapsed,
                base_s * 1000,
            )
            if elapsed >= target_s or size >= cfg.max_probe_bytes:
                transfer_s = max(elapsed - min(base_s, MAX_LATENCY_SHARE * elapsed), 1e-6)
                return min(size * 8 / 1e6 / transfer_s, MAX_REPORTED_MBPS), size
            factor = min(16.0, max(2.0, 1.5 * target_s / max(elapsed, 1e-6)))
            size = min(int(size * factor), cfg.max_probe_bytes)

    async def probe(self, peer_id: str) -> LinkEstimate:
        """Ping, then time one upload and one download to `peer_id`; update and return its estimate."""
        cfg = self.config
        link = self.links.setdefault(peer_id, LinkEstimate(probe_bytes=cfg.initial_probe_bytes))
        rtt_ms = min([await self.ping(peer_id) for _ in range(3)])
        link.rtt_ms = _ema(link.rtt_ms, rtt_ms, cfg.ema_alpha)
        link.min_rtt_ms = rtt_ms if link.min_rtt_ms is None else min(link.min_rtt_ms, rtt_ms)
        size = min(link.probe_bytes or cfg.initial_probe_bytes, cfg.max_probe_bytes)
        # The latency to discount is the path's base RTT (its minimum so far), not this round's pings:
        # those include the peers' scheduling delays (a CPU-capped volunteer answers up to a quota
        # period late), and subtracting them from a transfer inflated its rate by 20 % in the lab.
        base_s = link.min_rtt_ms / 1000
        up_mbps, up_size = await self._measure(peer_id, size, base_s, upload=True)
        down_mbps, down_size = await self._measure(peer_id, size, base_s, upload=False)
        alpha = 1.0 if link.num_probes == 0 else cfg.ema_alpha
        link.upload_mbps = _ema(link.upload_mbps, up_mbps, alpha)
        link.download_mbps = _ema(link.download_mbps, down_mbps, alpha)
        # remember the size that was long enough, so the next probe starts there
        link.probe_bytes = max(up_size, down_size)
        link.num_probes += 1
        link.last_probe_monotonic = time.monotonic()
        return link

    def _pick(self, candidates: Iterable[str], priority: Collection[str] = ()) -> list[str]:
        stale_before = time.monotonic() - self.config.priority_refresh_s

        def key(peer_id: str) -> tuple[int, float, str]:
            link = self.links.get(peer_id)
            last = link.last_probe_monotonic if link is not None else 0.0
            if peer_id in priority and (link is None or last < stale_before):
                return 0, last, peer_id
            return (1 if link is None else 2), last, peer_id

        return sorted(candidates, key=key)[: self.config.fanout]

    async def probe_round(self, candidates: Iterable[str], priority: Collection[str] = ()) -> int:
        """Probe `fanout` candidates (priority, unprobed, least recent); return how many succeeded."""
        ok = 0
        for peer_id in self._pick(candidates, priority):
            try:
                await self.probe(peer_id)
                ok += 1
            except TransportError as exc:
                logger.debug("probe to %s failed: %s", peer_id, exc)
        return ok

    async def run(
        self,
        candidates: Callable[[], Iterable[str]],
        on_update: Callable[[], None],
        priority: Callable[[], Collection[str]] | None = None,
    ) -> None:
        while True:
            peers = list(candidates())
            wanted = priority() if priority is not None else ()
            if peers and await self.probe_round(peers, wanted):
                on_update()
            # until every known peer has been probed once, come back sooner
            unprobed = any(p not in self.links for p in peers)
            await asyncio.sleep(
                min(2.0, self.config.period_s) if unprobed or not peers else self.config.period_s
            )

    def summary(self) -> tuple[float, float, float | None]:
        """(upload Mbit/s, download Mbit/s, median RTT ms) over the peers measured so far."""
        ups = [link.upload_mbps for link in self.links.values() if link.upload_mbps is not None]
        downs = [link.download_mbps for link in self.links.values() if link.download_mbps is not None]
        rtts = [link.rtt_ms for link in self.links.values() if link.rtt_ms is not None]
        return (max(ups, default=0.0), max(downs, default=0.0), statistics.median(rtts) if rtts else None)
