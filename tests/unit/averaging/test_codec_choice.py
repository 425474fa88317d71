"""The Δ codec per ring, from its slowest link (`codec_choice.py`), and mixed codecs in one sync."""

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import AveragerConfig, DeltaCompression, OuterAverager, OuterOptimizer, RingConfig
from ravnest_p2p.averaging import OuterOptimizerConfig as Outer
from ravnest_p2p.averaging.codec_choice import codec_for_rate, ring_rate_mbps
from tests.unit.averaging.helpers import fake_swarm, owned, replica
from tests.unit.averaging.test_outer import BUFFERS, cluster_digests, train_a_little

INT4, INT8, NONE = DeltaCompression.INT4, DeltaCompression.INT8, DeltaCompression.NONE
TABLE = ((50.0, INT4), (400.0, INT8))


def mbit(rate_mbps: float) -> float:
    return rate_mbps * 1e6 / 8  # link rates are in bytes/s


def test_the_first_row_below_which_the_slowest_link_falls_wins():
    assert codec_for_rate(TABLE, 25.0, NONE) is INT4
    assert codec_for_rate(TABLE, 50.0, NONE) is INT8  # "below" is strict
    assert codec_for_rate(TABLE, 399.0, NONE) is INT8
    assert codec_for_rate(TABLE, 1000.0, NONE) is NONE
    assert codec_for_rate(TABLE, None, INT8) is INT8  # unknown rates: the job's codec
    assert codec_for_rate((), 1.0, NONE) is NONE
    rates = {"a": (mbit(100), mbit(20)), "b": (mbit(1000), mbit(1000))}
    assert ring_rate_mbps(["a", "b"], rates) == pytest.approx(20.0)
    assert ring_rate_mbps(["a", "c"], rates) is None
    assert ring_rate_mbps(["a"], None) is None


def test_the_table_is_validated_and_names_the_codecs_a_job_may_use():
    config = Outer.model_validate({"codec_by_link_mbps": [[50, "int4"], [400, "int8"]]})
    assert config.codec_by_link_mbps == TABLE
    assert config.kinds == {NONE, INT4, INT8}
    for bad in ([[400, "int8"], [50, "int4"]], [[0, "int4"]], [[50, "int4"], [50, "int8"]], [[50, "zip"]]):
        with pytest.raises(ValueError):
            Outer.model_validate({"codec_by_link_mbps": bad})


async def test_rings_through_a_slow_link_carry_int4_the_others_fp32_and_replicas_stay_identical():
    _net, shard_map, servers, cluster_of = await fake_swarm(3, RingConfig(part_size_bytes=4096))
    slow = next(p for p, c in cluster_of.items() if c == 2)  # cluster 2's first stage: 20 Mbit/s
    rates = {p: (mbit(20), mbit(20)) if p == slow else (mbit(1000), mbit(1000)) for p in servers}
    start = replica(0)
    live = {p: {n: t.clone() for n, t in owned(shard_map, p, start).items()} for p in servers}
    averagers = {}
    for p in servers:
        outer = OuterOptimizer(Outer(codec_by_link_mbps=TABLE), plain=BUFFERS)
        outer.initialise(live[p])

        def write(named, mine=live[p]):
            for name, value in named.items():
                mine[name].copy_(value)

        averagers[p] = OuterAverager(
            AveragerConfig(period_steps=1),
            servers[p],
            outer=outer,
            read=lambda mine=live[p]: mine,
            write=write,
            shard_map=lambda: shard_map,
            link_rates=lambda: rates,
        )
    for r in range(3):
        train_a_little(live, cluster_of, r)
        metrics = await asyncio.gather(*(a.run_round(r) for a in averagers.values()))
        digests = cluster_digests(live, cluster_of)
        assert digests[0] == digests[1] == digests[2]
    kinds = averagers[slow]._ring_kinds(shard_map)
    for shard in shard_map.shards:
        expected = INT4 if slow in shard.owners else NONE
        assert all(averagers[p]._ring_kinds(shard_map)[shard.ring_id] is expected for p in shard.owners)
        rings = [x for m in metrics for x in m.rings if x.ring_id == shard.ring_id]
        per_element = sum(x.bytes_sent for x in rings) / shard.numel  # over the 3 members
        if expected is INT4:  # ~ 2(C-1) * (1/2 + 4/1024) = 2.0, small parts' scales aside
            assert per_element < 4.0
        else:  # fp32: 2(C-1) * 4 = 16
            assert per_element > 15.0
    assert INT4 in kinds.values()
    for p, averager in averagers.items():  # the anchors of both kinds of ring are the live values
        assert all(torch.equal(t, live[p][n]) for n, t in averager.outer.theta.items())
