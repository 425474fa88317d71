"""The sync_backup layout: balanced disjoint shards, stable owners under failures, batch slots."""

from __future__ import annotations

import pytest

from ravnest_p2p.strategies.sync_layout import (
    SyncLayout,
    batch_slot,
    deal_owners,
    owner_of,
    shard_parameters,
)


def test_shards_cover_every_tensor_once_and_balance_bytes() -> None:
    sizes = {"a": 100, "b": 10, "c": 60, "d": 50, "e": 5}
    shards = shard_parameters(sizes, 2)
    assert sorted(n for s in shards for n in s) == sorted(sizes)
    loads = sorted(sum(sizes[n] for n in s) for s in shards)
    assert loads == [110, 115]  # largest first into the lighter shard
    # model order inside a shard, and never more shards than tensors
    assert all(list(s) == sorted(s, key=list(sizes).index) for s in shards)
    assert len(shard_parameters(sizes, 9)) == len(sizes)


def test_shards_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="no parameters"):
        shard_parameters({}, 1)
    with pytest.raises(ValueError, match="num_shards"):
        shard_parameters({"a": 1}, 0)


def test_owners_are_deterministic_and_only_a_dead_owners_shards_move() -> None:
    workers = [f"peer-{i}" for i in range(5)]
    sizes = {f"t{i}": 10 + i for i in range(12)}
    layout = SyncLayout.build("job", workers, sizes, num_shards=8)
    again = SyncLayout.build("job", list(workers), dict(sizes), num_shards=8)
    assert layout.owners() == again.owners()
    before = layout.owners()
    victim = before[0]
    after = layout.owners({victim})
    for shard, (old, new) in enumerate(zip(before, after, strict=True)):
        assert new != victim
        if old != victim:
            assert new == old, f"shard {shard} moved although its owner lives"
    assert sorted(s for w in workers for s in layout.shards_of(w)) == list(range(8))
    with pytest.raises(ValueError, match="no live candidate"):
        layout.owners(set(workers))


def test_owner_hash_depends_on_the_key() -> None:
    peers = [f"p{i}" for i in range(16)]
    assert len({owner_of(f"job/{k}", peers) for k in range(64)}) > 8


def test_layout_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="distinct"):
        SyncLayout("job", ("a", "a"), (("x",),))
    with pytest.raises(ValueError, match="disjoint"):
        SyncLayout("job", ("a", "b"), (("x",), ("x",)))


def test_batch_slots_tile_the_data_epochs() -> None:
    slots = [batch_slot(step, w, 3, 7) for step in range(7) for w in range(3)]
    assert slots == [divmod(i, 7) for i in range(21)]
    with pytest.raises(ValueError):
        batch_slot(0, 3, 3, 7)


def test_owner_candidates_own_every_shard_and_the_others_take_over_only_when_all_are_dead() -> None:
    workers = ["a", "b", "c", "d", "slow"]
    sizes = {f"t{i}": 100 + i for i in range(10)}
    layout = SyncLayout.build("job", workers, sizes, 5, candidates=["a", "b", "c"])
    assert set(layout.owners()) <= {"a", "b", "c"}
    assert layout.shards_of("slow") == []
    assert layout.shards_of("d") == []
    moved = layout.owners({"a"})
    assert set(moved) <= {"b", "c"}
    # only a's shards moved
    assert all(new == old for old, new in zip(layout.owners(), moved, strict=True) if old != "a")
    # every candidate dead: the live workers own again (a smaller set never stops the job)
    assert set(layout.owners({"a", "b", "c"})) <= {"d", "slow"}
    with pytest.raises(ValueError, match="subset"):
        SyncLayout.build("job", workers, sizes, 5, candidates=["stranger"])


@pytest.mark.parametrize("num_workers", [2, 4, 5, 16])
def test_one_shard_per_candidate_gives_every_candidate_one_whatever_the_job_id(num_workers: int) -> None:
    workers = [f"peer-{i}" for i in range(num_workers)]
    sizes = {f"t{i}": 1000 + 37 * i for i in range(3 * num_workers)}
    for job in range(50):  # the hash alone gave some owner two of n shards for most ids
        layout = SyncLayout.build(f"job-{job}", workers, sizes)
        assert sorted(layout.owners()) == sorted(workers)


def test_deal_is_largest_first_to_the_lightest_owner_and_salted_by_the_job() -> None:
    sizes = [50, 40, 30, 20, 10, 10]
    owners = deal_owners("job", sizes, ["a", "b", "c"])
    loads = {peer: sum(s for s, o in zip(sizes, owners, strict=True) if o == peer) for peer in "abc"}
    assert sorted(loads.values()) == [50, 50, 60]  # within one shard of each other
    assert owners == deal_owners("job", sizes, ["c", "a", "b"])  # the candidates' order does not matter
    firsts = {deal_owners(f"job-{k}", [1, 1, 1], ["a", "b", "c"])[0] for k in range(30)}
    assert firsts == {"a", "b", "c"}  # two jobs deal their first shard to different peers
    with pytest.raises(ValueError, match="no candidate"):
        deal_owners("job", [1], [])


def test_a_shard_moves_only_when_its_holder_dies_whatever_the_order_of_deaths() -> None:
    workers = [f"peer-{i}" for i in range(6)]
    sizes = {f"t{i}": 100 + i for i in range(24)}
    layout = SyncLayout.build("job", workers, sizes, num_shards=12)
    for first in workers:
        one = layout.owners({first})
        for second in workers:
            if second == first:
                continue
            two = layout.owners({first, second})
            assert all(new == old for old, new in zip(one, two, strict=True) if old != second)
            assert not {first, second} & set(two)
