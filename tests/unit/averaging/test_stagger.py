"""Staggered syncs: balanced fragments, the schedule, and fragments' syncs overlapping on the rings."""

import asyncio
import itertools

import pytest
import torch

from ravnest_p2p.averaging import DeltaCompression, OuterOptimizerConfig
from ravnest_p2p.averaging.shards import build_shard_map
from ravnest_p2p.averaging.stagger import due_fragment, fragment_rings
from tests.unit.averaging.helpers import make_clusters
from tests.unit.averaging.test_outer import cluster_digests, make_swarm, train_a_little


def test_fragments_cover_every_ring_once_balanced_by_size():
    shard_map = build_shard_map(make_clusters(4), epoch=1)
    for num_fragments in (1, 2, 3):
        fragments = fragment_rings(shard_map, num_fragments)
        assert len(fragments) == num_fragments
        rings = [r for f in fragments for r in f]
        assert sorted(rings) == sorted(s.ring_id for s in shard_map.shards)
        sizes = [sum(shard_map.by_ring_id(r).numel for r in f) for f in fragments]  # type: ignore[union-attr]
        largest = max(s.numel for s in shard_map.shards)
        assert max(sizes) - min(sizes) <= largest  # greedy: within one shard of each other
        assert fragment_rings(shard_map, num_fragments) == fragments  # the same on every peer
    with pytest.raises(ValueError, match="num_fragments"):
        fragment_rings(shard_map, 0)


@pytest.mark.parametrize(("period", "num_fragments"), [(12, 4), (10, 3), (2, 4), (50, 1)])
def test_every_fragment_syncs_once_per_period_at_staggered_steps(period, num_fragments):
    syncs = {f: [] for f in range(num_fragments)}
    rounds = []
    for step in range(1, 20 * period + 1):
        due = due_fragment(step, period, num_fragments)
        if due is not None:
            rounds.append(due[0])
            syncs[due[1]].append(step)
    assert len(set(rounds)) == len(rounds)  # distinct round indices
    spacing = max(1, period // num_fragments)
    for steps in syncs.values():
        assert steps  # every fragment syncs
        assert {b - a for a, b in itertools.pairwise(steps)} == {spacing * num_fragments}
    first = sorted(s[0] for s in syncs.values())
    assert len(set(first)) == num_fragments  # never two fragments at the same step


async def test_fragments_sync_concurrently_and_replicas_agree_on_every_fragment():
    config = OuterOptimizerConfig(compression=DeltaCompression.INT8, chunk_numel=64, num_fragments=2)
    live, averagers, cluster_of = await make_swarm(3, config, same_start=True)
    shard_map = next(iter(averagers.values()))._shard_map()
    fragments = fragment_rings(shard_map, 2)
    names = [{n for s in shard_map.shards if s.ring_id in f for n in s.names} for f in fragments]
    for r in range(4):
        train_a_little(live, cluster_of, r)
        before = {p: {n: t.clone() for n, t in v.items()} for p, v in live.items()}
        # fragment r % 2 syncs; the other fragment's tensors are left as trained
        metrics = await asyncio.gather(
            *(a.run_round(r, ring_ids=fragments[r % 2]) for a in averagers.values())
        )
        assert all(len(x.participants) == 3 for m in metrics if m is not None for x in m.rings)
        for p in live:
            for n in names[1 - r % 2] & set(live[p]):
                assert torch.equal(live[p][n], before[p][n])
        digests = cluster_digests(live, cluster_of)
        for n in names[r % 2]:
            assert digests[0][n] == digests[1][n] == digests[2][n]
    # two fragments' syncs running at once on the same rings' servers, as a replica does when one is slow
    train_a_little(live, cluster_of, 9)
    await asyncio.gather(
        *(a.run_round(10 + f, ring_ids=fragments[f]) for a in averagers.values() for f in range(2))
    )
    digests = cluster_digests(live, cluster_of)
    assert digests[0] == digests[1] == digests[2]
