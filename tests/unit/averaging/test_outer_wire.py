"""Encoded Δ on the ring (in-memory transport): real bytes, exact sums, error feedback, dead members."""

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import DeltaCompression, OuterOptimizerConfig, RingConfig
from ravnest_p2p.averaging.deltawire import WireCodec
from tests.unit.averaging.helpers import fake_swarm, mean_of, owned, replica
from tests.unit.averaging.test_outer import cluster_digests, make_swarm, train_a_little

PARTS = RingConfig(part_size_bytes=4096, step_timeout_s=2.0, probe_timeout_s=0.5)


def deltas(seed: int, *, sparse: bool = False) -> dict[str, torch.Tensor]:
    out = {n: 0.01 * t for n, t in replica(seed).items()}
    if sparse:
        for t in out.values():
            t[t.abs() < 0.015] = 0  # ~13 % kept
    return out


async def ring_round(num_clusters, wire, inputs, *, config=PARTS):
    _net, shard_map, servers, cluster_of = await fake_swarm(num_clusters, config)
    errors = {p: {} for p in servers}
    results = await asyncio.gather(
        *(
            servers[p].all_reduce(
                shard_map,
                owned(shard_map, p, inputs[cluster_of[p]]),
                round_index=0,
                wire=wire,
                errors=errors[p],
            )
            for p in servers
        )
    )
    return shard_map, cluster_of, dict(zip(servers, results, strict=True)), errors


@pytest.mark.parametrize(("kind", "ratio"), [(DeltaCompression.INT8, 0.25), (DeltaCompression.INT4, 0.125)])
async def test_quantised_parts_cut_the_real_bytes_and_every_member_gets_the_same_bits(kind, ratio):
    inputs = [deltas(s) for s in range(4)]
    *_, plain, _ = await ring_round(4, None, inputs)
    shard_map, _cluster_of, coded, errors = await ring_round(4, WireCodec(kind, 1024), inputs)
    fp32 = sum(m.bytes_sent for _, m in plain.values())
    sent = sum(m.bytes_sent for _, m in coded.values())
    assert sent == sum(m.bytes_received for _, m in coded.values())
    # 1 byte (1/2) per element + 4 per block (at least one per part: the toy shards' parts are small)
    assert ratio < sent / fp32 < ratio + 0.03
    expected = mean_of(inputs)
    largest = max(t.abs().max() for t in expected.values())
    for shard in shard_map.shards:
        outs = [coded[p][0] for p in shard.owners]
        for name in shard.names:
            assert all(torch.equal(o[name], outs[0][name]) for o in outs)  # the same decoded average
            # error feedback: what the members' encodings dropped is exactly what the mean lacks
            lost = sum(errors[p][name].double() for p in shard.owners) / len(shard.owners)
            torch.testing.assert_close(outs[0][name].double() + lost, expected[name], atol=1e-6, rtol=0)
            # every hop rounds to half a step of its block (blocks span tensors: the largest sets it)
            bound = largest * (0.3 if kind is DeltaCompression.INT4 else 0.02)
            assert (outs[0][name].double() - expected[name]).abs().max() < bound


async def test_sparse_parts_sum_exactly_and_cost_what_they_carry():
    inputs = [deltas(s, sparse=True) for s in range(3)]
    *_, plain, _ = await ring_round(3, None, inputs)
    shard_map, _, coded, errors = await ring_round(3, WireCodec(DeltaCompression.TOPK), inputs)
    assert not any(errors.values())  # lossless: nothing to feed back
    expected = mean_of(inputs)
    for shard in shard_map.shards:
        for peer in shard.owners:
            for name in shard.names:
                torch.testing.assert_close(coded[peer][0][name].double(), expected[name], atol=1e-7, rtol=0)
    fp32 = sum(m.bytes_sent for _, m in plain.values())
    assert sum(m.bytes_sent for _, m in coded.values()) < 0.6 * fp32


async def test_members_with_different_codecs_refuse_each_other():
    _net, shard_map, servers, cluster_of = await fake_swarm(2, PARTS)
    inputs = [deltas(s) for s in range(2)]
    codecs = [WireCodec(DeltaCompression.INT8, 1024), WireCodec(DeltaCompression.INT8, 512)]
    results = await asyncio.gather(
        *(
            servers[p].all_reduce(
                shard_map,
                owned(shard_map, p, inputs[cluster_of[p]]),
                round_index=0,
                wire=codecs[cluster_of[p]],
            )
            for p in servers
        )
    )
    for _, metrics in results:
        assert all(len(r.participants) == 1 for r in metrics.rings)


async def test_a_cluster_dying_mid_sync_is_left_out_and_nothing_is_applied_half_way():
    # the kill is timed by polling the victim's sessions: on a busy host the whole sync can finish first
    # (then the run shows nothing), so the scenario is tried afresh a few times
    for _ in range(5):
        if await _a_sync_with_a_kill():
            return
    pytest.skip("every sync finished before the kill landed (a very busy host): nothing was interrupted")


async def _a_sync_with_a_kill() -> bool:
    """One swarm, two good syncs, a third with one cluster killed mid-way; False if the kill came late."""
    config = OuterOptimizerConfig(compression=DeltaCompression.INT8, chunk_numel=64)
    nets = []
    small = PARTS.model_copy(update={"part_size_bytes": 1024})
    live, averagers, cluster_of = await make_swarm(3, config, same_start=True, ring_config=small, nets=nets)
    net = nets[0]
    for r in range(2):  # two good syncs first: momentum in use
        train_a_little(live, cluster_of, r)
        await asyncio.gather(*(a.run_round(r) for a in averagers.values()))
    victim = next(p for p, c in cluster_of.items() if c == 2)
    before = {n: t.clone() for n, t in averagers[victim].outer.theta.items()}
    momentum = {n: t.clone() for n, t in averagers[victim].outer.momentum.items()}
    train_a_little(live, cluster_of, 2)
    victim_live = {n: t.clone() for n, t in live[victim].items()}
    net.delay_s = 0.01

    async def kill_soon():  # as soon as the victim's parts are on the wire
        sessions = averagers[victim].rings._sessions
        async with asyncio.timeout(5):
            while not any(s.running and s.bytes_sent for s in sessions.values() if s.round == 2):
                await asyncio.sleep(0.001)
        net.kill(victim)

    metrics = dict(
        zip(
            averagers,
            await asyncio.gather(*(a.run_round(2) for a in averagers.values()), kill_soon()),
            strict=False,
        )
    )
    # per ring: the victim either completed it before it died (the step applied whole) or took no step
    victim_outer = averagers[victim].outer
    interrupted = set()
    for ring in metrics[victim].rings:
        shard = next(s for s in shard_map_of(averagers[victim]).shards if s.ring_id == ring.ring_id)
        if len(ring.participants) > 1:
            continue
        interrupted.add(ring.ring_id)
        for n in shard.names:
            assert torch.equal(victim_outer.theta[n], before[n])
            assert torch.equal(live[victim][n], victim_live[n])
            if n in momentum:
                assert torch.equal(victim_outer.momentum[n], momentum[n])
    if not interrupted:
        return False  # the kill came too late to interrupt a ring
    # the survivors of every ring took the same step (`commit.py`: a member whose attempt failed after
    # another's completed applies or fetches that mean instead of keeping its values)
    shard_map = shard_map_of(averagers[victim])
    for shard in shard_map.shards:
        alive = [p for p in shard.owners if p != victim]
        rings = [next(r for r in metrics[p].rings if r.ring_id == shard.ring_id) for p in alive]
        assert len({r.participants for r in rings}) == 1, [r.participants for r in rings]
        for n in shard.names:
            assert all(torch.equal(live[p][n], live[alive[0]][n]) for p in alive)
            assert all(
                torch.equal(averagers[p].outer.theta[n], averagers[alive[0]].outer.theta[n]) for p in alive
            )
    digests = cluster_digests(live, cluster_of)
    assert digests[0] != digests[2]
    return True


def shard_map_of(averager):
    return averager._shard_map()
