"""The agreed plan carries its members' link rates; every ring member picks the same Δ codec from them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from ravnest_p2p.averaging import AveragerConfig, DeltaCompression, OuterAverager, OuterOptimizer
from ravnest_p2p.averaging import OuterOptimizerConfig as Outer
from ravnest_p2p.planning import JobParams, PeerLinkRate, Plan, make_plan, model_memory_bytes
from ravnest_p2p.training.placement import assignment_from_plan
from ravnest_p2p.training.role import StageRole, role_for
from tests.unit.planning.helpers import random_layers, random_peers
from tests.unit.training.test_role import JOB

from ._fakes import make_plan as fake_plan

INT4, INT8, NONE = DeltaCompression.INT4, DeltaCompression.INT8, DeltaCompression.NONE
TABLE = ((50.0, INT4), (400.0, INT8))
CLUSTERS = ([("a", 0, 1), ("b", 1, 3)], [("c", 0, 2), ("d", 2, 3)])


def mbit(rate_mbps: float) -> float:
    return rate_mbps * 1e6 / 8  # plan rates are bytes/s


def with_rates(plan: Plan, mbps: dict[str, float]) -> Plan:
    rates = tuple(
        PeerLinkRate(peer_id=p, upload_bytes_per_s=mbit(r), download_bytes_per_s=mbit(r))
        for p, r in mbps.items()
    )
    return plan.model_copy(update={"link_rates": rates})


def codecs(role: StageRole, config: Outer) -> dict[str, DeltaCompression]:
    """Ring id -> codec, as this member's outer averager chooses it (the rates it is given: the role's)."""
    assert role.shard_map is not None
    rings = cast(Any, SimpleNamespace(peer_id=role.peer_id))  # choosing the codec reads only the peer id
    averager = OuterAverager(
        AveragerConfig(period_steps=1),
        rings,
        outer=OuterOptimizer(config),
        read=dict,
        write=lambda named: None,
        shard_map=lambda: role.shard_map,
        link_rates=lambda: role.plan_link_rates,
    )
    return averager._ring_kinds(role.shard_map)


def member_roles(plan: Plan) -> dict[str, StageRole]:
    out = {}
    for peer in "abcd":
        # each member reads its own copy of the agreed plan (as it came off the wire)
        own = Plan.model_validate_json(plan.model_dump_json())
        assert own.digest() == plan.digest()
        role = role_for(JOB, own, peer, num_train_samples=204)
        assert role is not None
        out[peer] = role
    return out


def test_make_plan_records_every_cluster_members_rates_inside_the_digest():
    rng = np.random.default_rng(3)
    job = JobParams(micro_batch_size=4, max_in_flight=3)
    layers = random_layers(rng, 6)
    peers = random_peers(rng, 8, (model_memory_bytes(layers, job) // 4, model_memory_bytes(layers, job) // 2))
    plan = make_plan(peers, layers, job, epoch=2)
    planned = sorted(p for c in plan.clusters for p in c.peer_ids)
    assert [r.peer_id for r in plan.link_rates] == planned
    by_id = {p.peer_id: p for p in peers}
    rates = plan.rates_by_peer()
    assert rates is not None
    assert all(rates[p] == (by_id[p].upload_bytes_per_s, by_id[p].download_bytes_per_s) for p in planned)
    # the figures are part of what the members agree on
    slower = plan.link_rates[0].model_copy(update={"upload_bytes_per_s": 1.0})
    changed = plan.model_copy(update={"link_rates": (slower, *plan.link_rates[1:])})
    assert changed.digest() != plan.digest()


def test_ring_members_choose_the_same_codec_from_the_agreed_plan():
    config = Outer(codec_by_link_mbps=TABLE)
    # c uploads at 25 Mbit/s: the rings it is in (stage 0's layers) go int4, b and d's at 200 int8
    plan = with_rates(fake_plan(4, *CLUSTERS), {"a": 1000, "b": 200, "c": 25, "d": 1000})
    roles = member_roles(plan)
    chosen = {p: codecs(r, config) for p, r in roles.items()}
    shard_map = roles["a"].shard_map
    assert shard_map is not None
    seen = set()
    for shard in shard_map.shards:
        kinds = {chosen[p][shard.ring_id] for p in shard.owners}
        assert len(kinds) == 1  # every member of the ring agrees
        seen |= kinds
        assert kinds == ({INT4} if "c" in shard.owners else {INT8})
    assert seen == {INT4, INT8}


def test_without_plan_rates_the_configured_codec_is_used():
    config = Outer(compression=INT8, codec_by_link_mbps=((50.0, INT4),))
    for plan in (fake_plan(4, *CLUSTERS), with_rates(fake_plan(4, *CLUSTERS), {"a": 10, "b": 10, "c": 10})):
        roles = member_roles(plan)  # no rates at all; or d's missing: its rings fall back
        for peer, role in roles.items():
            for ring_id, kind in codecs(role, config).items():
                missing = plan.rates_by_peer() is None or peer == "d" or "d" in ring_members(role, ring_id)
                assert kind is (INT8 if missing else INT4)
    # an explicit assignment (no agreed plan): no rates
    explicit = role_for(JOB, assignment_from_plan(fake_plan(4, *CLUSTERS)), "a", num_train_samples=204)
    assert explicit is not None
    assert explicit.plan_link_rates is None


def ring_members(role: StageRole, ring_id: str) -> tuple[str, ...]:
    assert role.shard_map is not None
    return next(tuple(s.ring) for s in role.shard_map.shards if s.ring_id == ring_id)
