"""Who may wait early for a ring round: members of expected rings, capped per sender; outsiders not."""

from __future__ import annotations

import contextlib

import pytest

from ravnest_p2p.averaging.early import PER_PEER, EarlySlots
from ravnest_p2p.averaging.session import RingRefused
from ravnest_p2p.averaging.shards import build_shard_map


def _map(epoch: int = 1):
    return build_shard_map([[("a", [("w", 10)])], [("b", [("w", 10)])]], epoch=epoch)


def test_an_expected_ring_admits_its_members_only_and_outside_the_shared_cap():
    slots = EarlySlots(max_total=1)
    shard_map = _map()
    slots.expect(shard_map)
    ring_id = shard_map.shards[0].ring_id
    with contextlib.ExitStack() as stack:
        with pytest.raises(RingRefused) as err:
            stack.enter_context(slots.hold(ring_id, "outsider"))
        assert err.value.code == "not_partner"
        for _ in range(PER_PEER):
            stack.enter_context(slots.hold(ring_id, "a"))
        with pytest.raises(RingRefused) as err:
            stack.enter_context(slots.hold(ring_id, "a"))
        assert err.value.code == "busy"
        stack.enter_context(slots.hold(ring_id, "b"))  # a's streams take nothing from b
        assert slots.waiting() == PER_PEER + 1
    assert slots.waiting() == 0


def test_unknown_rings_share_a_pool_capped_per_sender():
    slots = EarlySlots(max_total=PER_PEER + 1)
    with contextlib.ExitStack() as stack:
        for _ in range(PER_PEER):
            stack.enter_context(slots.hold("r", "outsider"))
        with pytest.raises(RingRefused):
            stack.enter_context(slots.hold("r", "outsider"))
        stack.enter_context(slots.hold("r", "a"))  # the partner still finds room
        with pytest.raises(RingRefused):
            stack.enter_context(slots.hold("r", "b"))  # the shared pool is full


def test_an_allow_list_decides_for_unknown_rings():
    slots = EarlySlots(max_total=0, allow=lambda ring_id, sender: sender == "a")
    with slots.hold("r", "a"):
        pass
    with pytest.raises(RingRefused), slots.hold("r", "z"):
        pass


def test_the_previous_map_stays_expected_for_one_epoch():
    slots = EarlySlots(max_total=0)
    old, new, newer = _map(1), _map(2), _map(3)
    slots.expect(old)
    slots.expect(new)
    with slots.hold(old.shards[0].ring_id, "a"):
        pass
    slots.expect(newer)
    with pytest.raises(RingRefused), slots.hold(old.shards[0].ring_id, "a"):
        pass  # unknown again, and the shared pool has no room
