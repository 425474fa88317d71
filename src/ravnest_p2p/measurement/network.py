"""How well this peer is connected: RTT pings and streamed bandwidth probes to a few peers, smoothed.

Each round the meter picks the `fanout` peers it has probed least recently, pings them, and times one
upload and one download of a probe payload. The payload grows (doubling, up to `max_probe_bytes`) until a
transfer takes at least `min_transfer_s`, so a fast link is not mis-measured by per-call overhead and a
slow link is not flooded. Estimates are exponential moving averages per peer; the peer's advertised
figure is the best over peers (a slow remote end limits a probe, our own link never looks faster than it
is). Probes are bounded in size and in rate (`period_s`), and a server answers at most a couple at once,
so probing cannot crowd out training traffic.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from ravnest_p2p.errors import InvalidMessage, TransportError
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint, RpcMethod

__all__ = ["LinkEstimate", "NetworkMeter", "ProbeConfig"]

logger = logging.getLogger(__name__)

MAX_PROBE_BYTES = 16 * 2**20


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
    max_probe_bytes: int = Field(default=8 * 2**20, ge=1024, le=MAX_PROBE_BYTES)
    min_transfer_s: float = Field(default=0.25, gt=0)
    ema_alpha: float = Field(default=0.3, gt=0, le=1)
    timeout_s: float = Field(default=20.0, gt=0)


@dataclass
class LinkEstimate:
    rtt_ms: float | None = None
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

    async def probe(self, peer_id: str) -> LinkEstimate:
        """Ping, then time one upload and one download to `peer_id`; update and return its estimate."""
        cfg = self.config
        link = self.links.setdefault(peer_id, LinkEstimate(probe_bytes=cfg.initial_probe_bytes))
        rtt_ms = min([await self.ping(peer_id) for _ in range(3)])
        link.rtt_ms = _ema(link.rtt_ms, rtt_ms, cfg.ema_alpha)
        size = min(link.probe_bytes or cfg.initial_probe_bytes, cfg.max_probe_bytes)

        start = time.perf_counter()
        await self._rpc.call(
            peer_id,
            PROBE,
            ProbeRequest(download_bytes=0),
            tensors=[torch.zeros(size, dtype=torch.uint8)],
            timeout_s=cfg.timeout_s,
        )
        up_s = time.perf_counter() - start
        self.bytes_sent += size

        start = time.perf_counter()
        await self._rpc.call(peer_id, PROBE, ProbeRequest(download_bytes=size), timeout_s=cfg.timeout_s)
        down_s = time.perf_counter() - start

        # one round trip of each call is latency, not transfer
        base_s = rtt_ms / 1000
        too_short = min(up_s, down_s) < cfg.min_transfer_s and size < cfg.max_probe_bytes
        # while the payload is still growing, earlier (overhead-dominated) samples are worth nothing
        alpha = 1.0 if too_short or link.num_probes == 0 else cfg.ema_alpha
        link.upload_mbps = _ema(link.upload_mbps, size * 8 / 1e6 / max(up_s - base_s, 1e-6), alpha)
        link.download_mbps = _ema(link.download_mbps, size * 8 / 1e6 / max(down_s - base_s, 1e-6), alpha)
        if too_short:
            link.probe_bytes = min(size * 4, cfg.max_probe_bytes)
        link.num_probes += 1
        link.last_probe_monotonic = time.monotonic()
        return link

    def _pick(self, candidates: Iterable[str]) -> list[str]:
        ordered = sorted(
            candidates, key=lambda p: (self.links.get(p, LinkEstimate()).last_probe_monotonic, p)
        )
        return ordered[: self.config.fanout]

    async def probe_round(self, candidates: Iterable[str]) -> int:
        """Probe the least recently probed `fanout` candidates; return how many succeeded."""
        ok = 0
        for peer_id in self._pick(candidates):
            try:
                await self.probe(peer_id)
                ok += 1
            except TransportError as exc:
                logger.debug("probe to %s failed: %s", peer_id, exc)
        return ok

    async def run(self, candidates: Callable[[], Iterable[str]], on_update: Callable[[], None]) -> None:
        while True:
            peers = list(candidates())
            if peers and await self.probe_round(peers):
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
