"""fetch_state over the in-memory transport: paged, checked, refused for strangers, all or nothing."""

from __future__ import annotations

import pytest
import torch

from ravnest_p2p.training.handover import (
    ExecutorSource,
    HandoverError,
    HandoverRefused,
    HandoverServer,
    StateChanged,
    _plan_pages,
    fetch_state,
)
from ravnest_p2p.training.stage_state import (
    TensorEntry,
    capture_state,
    expected_entries,
    merge_states,
    restore_state,
)
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

from .stage_state_helpers import assert_bit_equal, build_split, resnet_job, train_step, union_state


async def _served(job, split, *, allowed):
    network = FakeNetwork()
    stages = build_split(job, split)
    for seed in range(2):
        train_step(stages, seed)
    owners = [RpcEndpoint(network.create(f"owner{i}"), "run") for i in range(len(stages))]
    for rpc, stage in zip(owners, stages, strict=True):
        server = HandoverServer.of(rpc)
        await server.start()
        server.publish(job.job_id, ExecutorSource(stage), epoch=1, allowed=allowed)
    return network, stages, owners


async def test_a_new_owner_pulls_its_layers_from_two_previous_owners_exactly():
    job = resnet_job()
    network, old, owners = await _served(job, [(0, 2), (2, 5)], allowed={"new"})
    client = RpcEndpoint(network.create("new"), "run")
    [new] = build_split(job, [(1, 4)])
    expected = expected_entries(new)
    parts = [
        await fetch_state(
            client, owners[0].peer_id, job.job_id, layers=(1, 2), expected=expected, page_bytes=4096
        ),
        await fetch_state(
            client, owners[1].peer_id, job.job_id, layers=(2, 4), expected=expected, page_bytes=4096
        ),
    ]
    state = merge_states(parts)
    restore_state(new, state)
    reference = union_state(old)
    assert_bit_equal({n: reference[n] for n in state.tensors}, union_state([new]))
    assert new.num_steps == old[0].num_steps


async def test_named_fetch_checks_expected_digests_and_refuses_a_wrong_one():
    job = resnet_job()
    network, old, owners = await _served(job, [(0, 5)], allowed={"new"})
    client = RpcEndpoint(network.create("new"), "run")
    truth = capture_state(old[0])
    names = ["1.conv1.weight", "optim/1.conv1.weight/exp_avg", "0.1.num_batches_tracked"]
    got = await fetch_state(
        client, owners[0].peer_id, job.job_id, names, {n: truth.digests[n] for n in names}
    )
    assert list(got.tensors) == names
    assert_bit_equal(got.tensors, truth.subset(names).tensors)
    with pytest.raises(HandoverError, match="digest"):
        await fetch_state(client, owners[0].peer_id, job.job_id, names[:1], {names[0]: "0" * 16})


async def test_strangers_unknown_jobs_and_shape_mismatches_are_refused():
    job = resnet_job()
    network, _, owners = await _served(job, [(0, 5)], allowed={"member"})
    stranger = RpcEndpoint(network.create("stranger"), "run")
    member = RpcEndpoint(network.create("member"), "run")
    with pytest.raises(HandoverRefused, match="not_allowed"):
        await fetch_state(stranger, owners[0].peer_id, job.job_id, layers=(0, 5))
    with pytest.raises(HandoverRefused, match="no_state"):
        await fetch_state(member, owners[0].peer_id, "other-job", layers=(0, 5))
    wrong = {"1.conv1.weight": TensorEntry(name="1.conv1.weight", dtype="float32", shape=(1,))}
    with pytest.raises(HandoverError, match="expected"):
        await fetch_state(member, owners[0].peer_id, job.job_id, ["1.conv1.weight"], expected=wrong)
    with pytest.raises(HandoverError, match="at most"):
        await fetch_state(member, owners[0].peer_id, job.job_id, layers=(0, 5), max_total_bytes=100)
    assert HandoverServer.of(owners[0]).refused == 2


async def test_a_stage_that_trains_during_the_transfer_fails_the_fetch():
    job = resnet_job()
    network, old, owners = await _served(job, [(0, 5)], allowed={"new"})
    client = RpcEndpoint(network.create("new"), "run")
    server = HandoverServer.of(owners[0])
    calls = 0
    original = server._read

    def read_then_train(published, items):
        nonlocal calls
        calls += 1
        if calls == 2:
            train_step(old, 99)
        return original(published, items)

    server._read = read_then_train  # type: ignore[method-assign]
    with pytest.raises(StateChanged):
        await fetch_state(client, owners[0].peer_id, job.job_id, layers=(0, 5), page_bytes=4096)


def test_pages_respect_their_budget_and_cover_every_element():
    entries = [
        TensorEntry(name="0.a", dtype="float32", shape=(10,)),
        TensorEntry(name="0.b", dtype="float32", shape=(3000,)),
        TensorEntry(name="0.c", dtype="int64", shape=()),
    ]
    pages = _plan_pages(entries, 4096)
    for page in pages:
        assert sum(i.count * (8 if i.name == "0.c" else 4) for i in page) <= 4096
    covered = {}
    for page in pages:
        for item in page:
            covered.setdefault(item.name, []).append((item.start, item.count))
    assert covered["0.b"][0] == (0, 1014)
    assert sum(c for _, c in covered["0.b"]) == 3000
    assert covered["0.a"] == [(0, 10)]
    assert covered["0.c"] == [(0, 1)]


async def test_a_stage_starts_from_a_served_checkpoint_only_if_it_is_the_one_the_job_names():
    from ravnest_p2p.training.handover import StaticSource
    from ravnest_p2p.training.job import InitCheckpoint
    from ravnest_p2p.training.stage_hook import init_from_checkpoint
    from ravnest_p2p.training.stage_state import entries_digest

    job = resnet_job()
    [trained] = build_split(job, [(0, 5)])
    train_step([trained], 0)
    state = capture_state(trained)
    network = FakeNetwork()
    server_rpc = RpcEndpoint(network.create("client"), "run")
    server = HandoverServer.of(server_rpc)
    await server.start()
    server.publish("init-x", StaticSource(state), epoch=0, allowed={"peer"})
    peer_rpc = RpcEndpoint(network.create("peer"), "run")
    good = InitCheckpoint(
        peer_id="client", source_id="init-x", state_digest=entries_digest(state.entries().values())
    )

    [stage] = build_split(job.model_copy(update={"init_checkpoint": good}), [(2, 5)])
    assert await init_from_checkpoint(peer_rpc, job.model_copy(update={"init_checkpoint": good}), stage) > 0
    for name, param in stage.parameters_by_name().items():
        assert torch.equal(param, state.tensors[name])
    assert stage.num_steps == 0  # weights only: a fresh optimizer and schedule

    bad = good.model_copy(update={"state_digest": "0" * 64})
    [other] = build_split(job, [(2, 5)])
    before = union_state([other])
    with pytest.raises(HandoverError, match="not the one"):
        await init_from_checkpoint(peer_rpc, job.model_copy(update={"init_checkpoint": bad}), other)
    assert_bit_equal(before, union_state([other]))


async def test_asked_for_its_newest_state_of_some_layers_an_owner_serves_the_newest_plan_holding_them():
    # a split vote can leave a plan some holders never ran: asked for "the newest", an owner serves the
    # newest plan on which it holds those layers, not its newest plan (which may hold other layers)
    job = resnet_job()
    network = FakeNetwork()
    old, other = build_split(job, [(0, 2), (2, 5)])
    owner = RpcEndpoint(network.create("owner"), "run")
    server = HandoverServer.of(owner)
    await server.start()
    server.publish(job.job_id, ExecutorSource(old), epoch=2, allowed={"new"})
    server.publish(job.job_id, ExecutorSource(other), epoch=4, allowed={"new"})
    client = RpcEndpoint(network.create("new"), "run")
    state = await fetch_state(client, "owner", job.job_id, layers=(0, 2))
    assert state.tensors
    assert set(state.tensors) == set(union_state([old]))
    with pytest.raises(HandoverRefused):  # asked for that plan, it says it has no such state there
        await fetch_state(client, "owner", job.job_id, layers=(0, 2), epoch=3)
