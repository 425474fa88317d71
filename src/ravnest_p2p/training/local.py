"""One cluster's pipeline in one process over real p2p daemons: for tests, benchmarks and notebooks.

All stages share this process's single compute thread, so this measures *correctness and learning*,
not throughput (use `swarm.LocalSwarm` peers, one process each, for speed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence

from ravnest_p2p.runtime.service import PipelineConfig, StageService
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stages import build_stage, num_layers
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity

__all__ = ["even_split", "local_hosts", "local_pipeline"]


def even_split(total_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[first, end) layer ranges of `num_stages` near-equal contiguous stages."""
    if not 1 <= num_stages <= total_layers:
        raise ValueError(f"cannot cut {total_layers} layers into {num_stages} stages")
    bounds = [round(i * total_layers / num_stages) for i in range(num_stages + 1)]
    return list(itertools.pairwise(bounds))


@contextlib.asynccontextmanager
async def local_hosts(n: int) -> AsyncIterator[list[P2PTransport]]:
    """`n` loopback p2p hosts that know each other's addresses; all stopped on exit."""
    transports: list[P2PTransport] = []
    try:
        for _ in range(n):
            transports.append(await P2PTransport.create(HostConfig(), load_or_create_identity(None)))
        maddrs = {t.peer_id: await t.visible_maddrs() for t in transports}
        for t in transports:
            for peer_id, addrs in maddrs.items():
                if peer_id != t.peer_id:
                    t.add_addresses(peer_id, addrs)
        yield transports
    finally:
        await asyncio.gather(*(t.aclose() for t in transports), return_exceptions=True)


@contextlib.asynccontextmanager
async def local_pipeline(
    job: JobSpec,
    transports: Sequence[P2PTransport],
    *,
    max_in_flight: int,
    split: Sequence[tuple[int, int]] | None = None,
    epoch: int = 1,
    namespace: str = "local",
) -> AsyncIterator[list[StageService]]:
    """Started stage services of one cluster (stage i on transports[i]); closed on exit."""
    ranges = list(split or even_split(num_layers(job), len(transports)))
    peers = [t.peer_id for t in transports]
    services: list[StageService] = []
    try:
        for index, (transport, (first, end)) in enumerate(zip(transports, ranges, strict=True)):
            service = StageService(
                RpcEndpoint(transport, namespace),
                build_stage(job, first, end, max_in_flight=max_in_flight),
                epoch=epoch,
                cluster_peers=peers,
                stage_index=index,
                config=PipelineConfig(max_in_flight=max_in_flight, micro_batch_timeout_s=120),
            )
            await service.start()
            services.append(service)
        yield services
    finally:
        for service in services:
            await service.aclose()
