"""Streams from a stranger against real peers: announced lengths, half-open streams, slowloris, floods.

Each test runs real p2p daemons on loopback with the peers in this process (so this process's RSS is
the peers' memory), a training stage (`StageService`), the probe and gossip handlers on the same host,
and one or more attacker hosts that speak raw libp2p streams to them.
"""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
import torch

from ravnest_p2p.averaging import RingAllReduce, RingConfig
from ravnest_p2p.errors import PeerUnreachable
from ravnest_p2p.measurement.network import PING, PROBE, NetworkMeter, PingRequest, ProbeRequest
from ravnest_p2p.membership.gossip import Gossiper
from ravnest_p2p.membership.view import MembershipView
from ravnest_p2p.runtime.messages import MAX_ACTIVATION_BYTES
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.local import local_pipeline
from ravnest_p2p.transport import RpcEndpoint, WireLimits
from ravnest_p2p.transport.limits import GOSSIP_MAX_MESSAGE_BYTES, MAX_PROBE_BYTES, MIB
from tests.security._wire_support import (
    FRAME_LEN,
    close_all,
    hosts,
    open_raw,
    rss_bytes,
    timed,
    until_closed,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

JOB = JobSpec(
    model="digits_cnn",
    dataset="digits",
    batch_size=16,
    max_steps=4,
    seed=3,
    optimizer=OptimizerConfig(name="adam", lr=3e-3),
)
NS = "local"  # local_pipeline's namespace
RSS_BOUND = 64 * MIB


def _digest(services) -> str:
    h = hashlib.sha256()
    for service in services:
        for name, value in sorted(service.executor.parameters_by_name().items()):
            h.update(name.encode())
            h.update(value.detach().numpy().tobytes())
    return h.hexdigest()


async def _serve_extras(rpc: RpcEndpoint) -> None:
    """The probe and gossip handlers a peer serves, on the stage's endpoint."""
    await NetworkMeter(rpc).serve()
    await Gossiper(
        rpc, MembershipView(), get_epoch=lambda: 0, on_epoch=lambda e: None, on_news=lambda s, i: None
    ).serve()


def _stream(method: str) -> str:
    return f"ravnest/{NS}/{method}/stream"


ANNOUNCED = {  # method -> (surface, the largest frame it accepts)
    "forward": ("stream:rpc", MAX_ACTIVATION_BYTES),
    "probe_bandwidth": ("stream:probe", MAX_PROBE_BYTES),
    "gossip_view": ("stream:gossip", GOSSIP_MAX_MESSAGE_BYTES),
}


@pytest.mark.parametrize("method", list(ANNOUNCED))
async def test_announced_lengths_cost_no_memory_until_their_bytes_arrive(hostile, method):
    surface, size = ANNOUNCED[method]
    hostile.surface = surface
    async with (
        hosts(3) as (first, stage, attacker),
        local_pipeline(JOB, [first, stage], max_in_flight=2) as svc,
    ):
        await _serve_extras(svc[1].rpc)
        before_params = _digest(svc)
        budget = stage.budget
        rss_before = rss_bytes()
        writers = []
        for _ in range(4):  # four streams, 8 bytes each: only the length prefix
            _, writer = await open_raw(attacker, stage.peer_id, _stream(method))
            writer.write(FRAME_LEN.pack(size))
            await writer.drain()
            writers.append(writer)
            hostile.sent += 1
        await wait_until(
            lambda: budget.reservations + budget.refused >= len(writers),
            20,
            "every announcement was reserved or refused",
        )
        growth = rss_bytes() - rss_before
        hostile.peak_rss_growth_bytes = max(hostile.peak_rss_growth_bytes, growth)
        hostile.refused += budget.refused
        total = 4 * size
        # before: the stage reserved every announced byte at once (1 GiB for four forwards); 4 MiB of
        # slack for what else the process allocates meanwhile
        assert growth < min(RSS_BOUND, max(total / 4, 4 * MIB)), (
            f"RSS grew {growth / MIB:.1f} MiB for {total / MIB:.1f} announced"
        )
        assert budget.held(attacker.peer_id)[1] <= stage.limits.max_bytes_per_peer
        close_all(writers)
        await wait_until(lambda: budget.held() == (0, 0), 20, "the streams' budget was released")
        # the stage still serves its neighbour, and nothing changed
        assert (await svc[0].rpc.call(stage.peer_id, PING, PingRequest(), timeout_s=5)).message is not None
        assert _digest(svc) == before_params
        assert svc[1].executor.in_flight == ()


async def test_half_open_streams_are_closed_by_the_idle_deadline(hostile):
    hostile.surface = "stream:rpc"
    limits = WireLimits(idle_timeout_s=1.0)
    async with (
        hosts(4, limits=[None, limits]) as (first, stage, attacker, attacker2),
        local_pipeline(JOB, [first, stage], max_in_flight=2) as svc,
    ):
        await _serve_extras(svc[1].rpc)
        ring = RingAllReduce(svc[1].rpc, RingConfig(step_timeout_s=1.0))
        await ring.start()
        try:
            names = [_stream(m) for m in ("forward", "ping", "probe_bandwidth", "gossip_view")]
            names.append(f"ravnest/{NS}/ring_parts")

            gate = asyncio.Semaphore(8)  # the daemons' control sockets take a few opens at once well

            async def half_open(i: int):
                async with gate:
                    return await _half_open(i)

            async def _half_open(i: int):
                source = attacker if i % 2 else attacker2
                reader, writer = await open_raw(source, stage.peer_id, names[i % len(names)])
                kind = (i // len(names)) % 3
                if kind == 1:
                    writer.write(b"\0\0\0\0")  # half a length prefix
                elif kind == 2:
                    writer.write(FRAME_LEN.pack(10_000) + b"x" * 100)  # a tenth of a body
                await writer.drain()
                return reader, writer

            opened = await asyncio.gather(*(half_open(i) for i in range(200)))
            readers, writers = [r for r, _ in opened], [w for _, w in opened]
            hostile.sent += len(opened)
            closed = await asyncio.gather(*(until_closed(r, 15.0) for r in readers))
            hostile.refused += stage.budget.refused
            assert all(closed), f"{closed.count(False)} of 200 half-open streams still open after 15 s"
            await wait_until(lambda: stage.budget.held() == (0, 0), 10, "no slot held")
            close_all(writers)
            assert (
                await svc[0].rpc.call(stage.peer_id, PING, PingRequest(), timeout_s=5)
            ).message is not None
        finally:
            await ring.aclose()


async def _trickle(writer, seconds: float, rng: random.Random) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        writer.write(rng.randbytes(256))
        await writer.drain()
        await asyncio.sleep(0.2)


async def test_slowloris_of_100_streams_keeps_rss_bounded_and_pings_fast(hostile):
    hostile.surface = "stream:rpc"
    rng = random.Random(5)
    async with (
        hosts(6) as (first, stage, *attackers),
        local_pipeline(JOB, [first, stage], max_in_flight=2) as svc,
    ):
        await _serve_extras(svc[1].rpc)
        before_params = _digest(svc)
        client = svc[0].rpc
        await client.call(stage.peer_id, PING, PingRequest(), timeout_s=5)  # connected, warm
        rss_before = rss_bytes()
        sizes = {"forward": MAX_ACTIVATION_BYTES, "probe_bandwidth": MAX_PROBE_BYTES}
        writers = []
        for i in range(100):
            method = "forward" if i % 4 == 0 else "probe_bandwidth"
            _, writer = await open_raw(attackers[i % len(attackers)], stage.peer_id, _stream(method))
            writer.write(FRAME_LEN.pack(sizes[method]))
            writers.append(writer)
            hostile.sent += 1
        trickles = [asyncio.create_task(_trickle(w, 3.0, rng)) for w in writers]
        peak, latencies = 0, []
        try:
            while not all(t.done() for t in trickles):
                latencies.append(
                    await timed(lambda: client.call(stage.peer_id, PING, PingRequest(), timeout_s=5))
                )
                peak = max(peak, rss_bytes() - rss_before)
                await asyncio.sleep(0.1)
        finally:
            for task in trickles:
                task.cancel()
            await asyncio.gather(*trickles, return_exceptions=True)
            close_all(writers)
        hostile.peak_rss_growth_bytes = max(hostile.peak_rss_growth_bytes, peak)
        hostile.refused += stage.budget.refused
        assert peak <= RSS_BOUND, f"RSS grew {peak / MIB:.0f} MiB under a 100-stream slowloris"
        assert max(latencies) < 1.0, f"ping took {max(latencies):.2f}s under a slowloris"
        await wait_until(
            lambda: stage.budget.held() == (0, 0), 20, "the slowloris streams' budget was released"
        )
        assert _digest(svc) == before_params


async def test_a_ping_is_answered_within_a_second_under_a_flood(hostile):
    hostile.surface = "rpc:envelope"
    rng = random.Random(11)
    async with (
        hosts(3) as (first, stage, attacker),
        local_pipeline(JOB, [first, stage], max_in_flight=2) as svc,
    ):
        await _serve_extras(svc[1].rpc)
        client = svc[0].rpc
        await client.call(stage.peer_id, PING, PingRequest(), timeout_s=5)
        stop = asyncio.Event()
        counts = {"sent": 0, "refused": 0}

        async def flood_unary() -> None:
            while not stop.is_set():
                junk = rng.randbytes(rng.randrange(0, 3000))
                method = rng.choice(["ping", "forward", "gossip_view", "probe_bandwidth", "stage_ready"])
                try:
                    reply = await attacker.call(
                        stage.peer_id,
                        f"ravnest/{NS}/{method}",
                        junk,
                        stream=False,
                        max_response_bytes=1 << 20,
                    )
                    counts["refused"] += b'"error"' in bytes(reply) or b"error" in bytes(reply)
                except Exception:
                    pass
                counts["sent"] += 1

        async def flood_streams() -> None:
            while not stop.is_set():
                try:
                    _, writer = await open_raw(attacker, stage.peer_id, _stream("forward"))
                    writer.write(FRAME_LEN.pack(MAX_ACTIVATION_BYTES))
                    await writer.drain()
                    writer.close()
                except Exception:
                    pass
                counts["sent"] += 1

        floods = [asyncio.create_task(flood_unary()) for _ in range(6)]
        floods += [asyncio.create_task(flood_streams()) for _ in range(2)]
        try:
            await wait_until(lambda: counts["sent"] >= 50, 20, "the flood is under way")
            latencies = [
                await timed(lambda: client.call(stage.peer_id, PING, PingRequest(), timeout_s=5))
                for _ in range(10)
            ]
        finally:
            stop.set()
            await asyncio.gather(*floods, return_exceptions=True)
        hostile.sent += counts["sent"]
        hostile.refused += counts["refused"]
        assert max(latencies) < 1.0, f"pings under the flood: {[round(x, 3) for x in latencies]}"
        assert svc[1].executor.in_flight == ()
        assert svc[1].executor.weight_version == 0
        assert torch.is_grad_enabled()


async def test_a_hostile_server_cannot_hold_a_caller_with_an_announced_reply(hostile):
    """The caller side: a reply announcing 16 MiB that stalls after 8 bytes costs nothing, ends idle."""
    hostile.surface = "stream:probe"
    async with hosts(2, limits=[WireLimits(idle_timeout_s=1.0)]) as (caller, server):

        async def stall(info, reader, writer) -> None:
            length = int.from_bytes(await reader.readexactly(8), "big")
            await reader.readexactly(length)
            writer.write(FRAME_LEN.pack(MAX_PROBE_BYTES + 1000) + b"12345678")
            await writer.drain()
            await asyncio.sleep(30)

        await server.p2p.add_binary_stream_handler(_stream("probe_bandwidth"), stall)
        rpc = RpcEndpoint(caller, NS)
        rss_before = rss_bytes()
        for _ in range(4):
            hostile.sent += 1
            started = asyncio.get_running_loop().time()
            with pytest.raises(PeerUnreachable, match="idle"):
                await rpc.call(server.peer_id, PROBE, ProbeRequest(download_bytes=1 << 20), timeout_s=20)
            assert asyncio.get_running_loop().time() - started < 10
            hostile.refused += 1
        growth = rss_bytes() - rss_before
        hostile.peak_rss_growth_bytes = max(hostile.peak_rss_growth_bytes, growth)
        assert growth < 4 * MIB
