"""The shard map: cut at every split point of every cluster, one owner per cluster, deterministic rings."""

import pytest
import torch

from ravnest_p2p.averaging.shards import build_shard_map, floating_entries, layer_order_key
from tests.unit.averaging.helpers import SHAPES, make_clusters


@pytest.mark.parametrize("num_clusters", [2, 3, 4])
def test_every_name_in_exactly_one_shard_owned_once_per_cluster(num_clusters):
    clusters = make_clusters(num_clusters)
    shard_map = build_shard_map(clusters, epoch=3)
    seen = [n for s in shard_map.shards for n in s.names]
    assert sorted(seen) == sorted(SHAPES)
    assert seen == sorted(SHAPES, key=layer_order_key)  # canonical order, shards in layer order
    for shard in shard_map.shards:
        assert len(shard.owners) == num_clusters
        assert sorted(shard.ring) == sorted(shard.owners)
        for c, stages in enumerate(clusters):
            holders = [p for p, entries in stages if {n for n, _ in entries} >= set(shard.names)]
            assert holders == [shard.owners[c]]
        assert shard.numel == sum(torch.Size(SHAPES[n]).numel() for n in shard.names)


def test_cuts_are_the_union_of_all_clusters_split_points():
    # layers 0 1 2 3 4 10; cluster 0 cuts at 3, cluster 1 at 1 and 4 -> shards [0] [1 2] [3] [4 10]
    shard_map = build_shard_map(make_clusters(2), epoch=0)
    layers = [sorted({int(n.split(".")[0]) for n in s.names}) for s in shard_map.shards]
    assert layers == [[0], [1, 2], [3], [4, 10]]
    # adding cluster 2 (cuts 2, 3, 10) splits [1 2] and [4 10] further
    layers3 = [
        sorted({int(n.split(".")[0]) for n in s.names})
        for s in build_shard_map(make_clusters(3), epoch=0).shards
    ]
    assert layers3 == [[0], [1], [2], [3], [4], [10]]


def test_deterministic_and_ring_order_changes_with_epoch():
    clusters = make_clusters(4)
    assert build_shard_map(clusters, epoch=5) == build_shard_map(clusters, epoch=5)
    rings = {tuple(s.ring for s in build_shard_map(clusters, epoch=e).shards) for e in range(8)}
    assert len(rings) > 1
    ids = [s.ring_id for s in build_shard_map(clusters, epoch=5).shards]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("e5/") for i in ids)


def test_inconsistent_clusters_are_refused():
    clusters = make_clusters(2)
    bad = [clusters[0], [(clusters[1][0][0], list(clusters[1][0][1])[:-1]), *clusters[1][1:]]]
    with pytest.raises(ValueError, match="differs"):
        build_shard_map(bad, epoch=0)
    resized = [clusters[0], [(p, [(n, k + 1) for n, k in e]) for p, e in clusters[1]]]
    with pytest.raises(ValueError, match="differs"):
        build_shard_map(resized, epoch=0)
    twice = [
        clusters[0],
        [(p, list(e) + list(clusters[1][0][1])) for p, e in clusters[1][:1]] + clusters[1][1:],
    ]
    with pytest.raises(ValueError, match="two stages"):
        build_shard_map(twice, epoch=0)
    same_peer = [clusters[0], [("c0s0", e) for _, e in clusters[0]]]
    with pytest.raises(ValueError, match="two clusters"):
        build_shard_map(same_peer, epoch=0)


def test_peer_owning_several_stages_gets_merged_shards_and_integer_buffers_are_left_out():
    clusters = make_clusters(2)
    merged = [
        [("a", [e for _, es in clusters[0] for e in es])],
        [("b", [e for _, es in clusters[1] for e in es])],
    ]
    shard_map = build_shard_map(merged, epoch=0)
    assert len(shard_map.shards) == 1
    assert shard_map.shards_of("a") == list(shard_map.shards)
    bn = torch.nn.BatchNorm1d(4)
    entries = floating_entries(dict(bn.named_buffers()) | dict(bn.named_parameters()))
    assert {n for n, _ in entries} == {"running_mean", "running_var", "weight", "bias"}
