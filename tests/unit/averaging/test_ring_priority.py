"""Rings whose peers have a busy pipeline: parts yield to it, yet the round completes, exactly."""

import asyncio
import contextlib

import torch

from ravnest_p2p.averaging import RingAllReduce, RingConfig
from ravnest_p2p.averaging.shards import build_shard_map
from ravnest_p2p.averaging.streams import MemoryStreamHub
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.transport.priority import GateConfig
from tests.unit.averaging.helpers import make_clusters, mean_of, owned, replica

CONFIG = RingConfig(part_size_bytes=1024, step_timeout_s=2.0, probe_timeout_s=0.5)


async def test_round_completes_while_every_peer_keeps_a_foreground_send_open(monkeypatch):
    opened: list[str] = []
    open_stream = MemoryStreamHub._open

    def counting_open(hub, src, dst, name):
        opened.append(src)
        return open_stream(hub, src, dst, name)

    monkeypatch.setattr(MemoryStreamHub, "_open", counting_open)
    num_clusters = 3
    shard_map = build_shard_map(make_clusters(num_clusters), epoch=1)
    net = FakeNetwork()
    hub = MemoryStreamHub(net)
    servers, cluster_of = {}, {}
    gate_config = GateConfig(max_yield_s=0.005, window_bytes=2048)
    for c, stages in enumerate(make_clusters(num_clusters)):
        for peer_id, _ in stages:
            transport = net.create(peer_id)
            transport.gate = type(transport.gate)(gate_config)
            streams = hub.streams(peer_id, gate=transport.gate)
            servers[peer_id] = RingAllReduce(RpcEndpoint(transport, "run"), CONFIG, streams=streams)
            await servers[peer_id].start()
            cluster_of[peer_id] = c
    gates = [net.lookup(p).gate for p in servers]
    replicas = [replica(seed) for seed in range(num_clusters)]
    expected = mean_of(replicas)
    with contextlib.ExitStack() as stack:
        for gate in gates:
            stack.enter_context(gate.foreground())  # a pipeline that never pauses
        async with asyncio.timeout(10):
            results = await asyncio.gather(
                *(
                    servers[p].all_reduce(
                        shard_map, owned(shard_map, p, replicas[cluster_of[p]]), round_index=0
                    )
                    for p in servers
                )
            )
    for averaged, metrics in results:
        assert all(ring.attempts == 1 for ring in metrics.rings)
        for name, value in averaged.items():
            torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
    assert sum(g.stats.forced_turns for g in gates) > 0  # the parts waited, boundedly
    assert all(g.stats.yielded_turns == 0 for g in gates)
    # one part stream per ring and member while the pipeline sends (two would claim two shares)
    assert CONFIG.streams_per_neighbour == 2
    assert len(opened) == sum(len(shard.ring) for shard in shard_map.shards)
    for server in servers.values():
        await server.aclose()
    await hub.aclose()
