"""An outsider's early ring streams must not make an honest partner's stream ``busy`` (real daemons).

The outsider knows the ring id and the round (both are easy to guess) and opens many part streams to a
member before the round, each with a valid-looking hello, so that they wait as "early" streams. Then the
two members run the round, one starting later than the other, so the first one's stream is early too.
The round must complete in its first attempt: the partner's stream was never refused.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import RingAllReduce, RingConfig, build_shard_map
from ravnest_p2p.averaging.frames import write_hello
from ravnest_p2p.averaging.messages import StreamHello
from ravnest_p2p.averaging.session import members_digest
from ravnest_p2p.transport import RpcEndpoint
from tests.security._wire_support import close_all, hosts, open_raw, wait_until

pytestmark = pytest.mark.timeout(120)

NUMEL = 300_000


@pytest.mark.parametrize("knows_the_map", [True, False], ids=["map-known", "map-unknown"])
async def test_outsider_early_streams_do_not_refuse_the_partner(hostile, knows_the_map):
    hostile.surface = "stream:ring"
    config = RingConfig(
        step_timeout_s=4.0, probe_timeout_s=1.0, round_timeout_s=30.0, max_buffered_messages=16
    )
    async with hosts(3) as (a, b, outsider):
        rings = [RingAllReduce(RpcEndpoint(t, "ring"), config) for t in (a, b)]
        for ring in rings:
            await ring.start()
        writers = []
        try:
            shard_map = build_shard_map(
                [[(a.peer_id, [("w", NUMEL)])], [(b.peer_id, [("w", NUMEL)])]], epoch=1
            )
            (shard,) = shard_map.shards
            if knows_the_map:
                for ring in rings:
                    ring.expect(shard_map)
            hello = StreamHello(
                ring_id=shard.ring_id, epoch=1, round=0, attempt=0, members_digest=members_digest(shard.ring)
            )
            target = rings[1]
            refused_before = b.budget.refused + target.early.refused

            async def early_stream() -> asyncio.StreamWriter:
                _, writer = await open_raw(outsider, b.peer_id, "ravnest/ring/ring_parts")
                write_hello(writer, hello)
                await writer.drain()
                return writer

            writers = list(await asyncio.gather(*(early_stream() for _ in range(40))))
            hostile.sent += len(writers)
            await wait_until(
                lambda: (
                    target.early.waiting() + b.budget.refused + target.early.refused - refused_before >= 40
                ),
                10,
                "every outsider stream waits or was refused",
            )
            held_by_outsider = target.early.waiting()
            hostile.refused += 40 - held_by_outsider
            assert held_by_outsider <= (0 if knows_the_map else 8)

            async def run(index: int, value: float, delay_s: float):
                await asyncio.sleep(delay_s)
                tensors = {"w": torch.full((NUMEL,), value)}
                return await rings[index].all_reduce(shard_map, tensors, round_index=0)

            (avg_a, metrics_a), (avg_b, metrics_b) = await asyncio.gather(run(0, 1.0, 0.0), run(1, 3.0, 0.5))
            for averaged, metrics in ((avg_a, metrics_a), (avg_b, metrics_b)):
                (ring_metrics,) = metrics.rings
                assert set(ring_metrics.participants) == {a.peer_id, b.peer_id}
                assert ring_metrics.attempts == 1, "the partner's stream was refused (a second attempt ran)"
                torch.testing.assert_close(averaged["w"], torch.full((NUMEL,), 2.0))
        finally:
            close_all(writers)
            for ring in rings:
                await ring.aclose()
