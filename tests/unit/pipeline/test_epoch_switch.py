"""A cluster that keeps its place in a new plan switches epochs in place, stage by stage, without drops."""

from __future__ import annotations

import asyncio

import pytest

from ravnest_p2p.errors import RemoteError
from ravnest_p2p.runtime.epochs import EpochSwitch
from ravnest_p2p.runtime.messages import FORWARD, PING, ForwardRequest, PingRequest
from ravnest_p2p.runtime.service import PipelineConfig, StageService
from ravnest_p2p.training.local import even_split
from ravnest_p2p.training.stages import build_stage, num_layers
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.utils import wait_until

from .test_service_fake import JOB, batches, make_cluster

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_old_epoch_is_accepted_for_the_transition_window_and_sent_until_a_peer_takes_the_new():
    clock = Clock()
    switch = EpochSwitch(3, transition_s=10.0, clock=clock)
    assert switch.accepts(3)
    assert not switch.accepts(4)
    assert not switch.accepts(2)
    assert switch.for_peer("a") == 3
    assert switch.pending("a") is None
    switch.move_to(4)
    assert switch.accepts(3)
    assert switch.accepts(4)
    assert not switch.accepts(5)
    assert switch.for_peer("a") == 3  # not known to take 4 yet
    assert switch.pending("a") == 4
    switch.heard("a", 3)
    assert switch.for_peer("a") == 3
    switch.heard("a", 4)
    assert switch.for_peer("a") == 4
    assert switch.pending("a") is None
    switch.heard("b", 5)  # an epoch we do not accept says nothing
    assert switch.for_peer("b") == 3
    clock.now = 10.5  # the window is over: only the new epoch, to everyone
    assert not switch.accepts(3)
    assert switch.for_peer("b") == 4
    assert not switch.in_transition
    with pytest.raises(ValueError):
        switch.move_to(4)


def test_two_quick_switches_send_each_peer_the_newest_epoch_it_takes():
    clock = Clock()
    switch = EpochSwitch(3, transition_s=10.0, clock=clock)
    switch.move_to(4)
    clock.now = 1.0
    switch.move_to(6)
    switch.heard("a", 4)
    assert switch.for_peer("a") == 4
    assert switch.for_peer("b") == 3
    assert switch.accepts(3)
    assert switch.accepts(4)
    assert switch.accepts(6)
    assert not switch.accepts(5)


async def test_a_cluster_switches_epoch_stage_by_stage_while_training_and_drops_nothing():
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=3, heartbeat_period_s=0.05, neighbour_timeout_s=5.0)
    first, middle, last = services
    stream = batches() * 6  # 60 micro-batches

    async def switch() -> None:
        await wait_until(lambda: first.stats.completed >= 5, 10, message="training")
        middle.move_to_epoch(4)  # the stages see the new plan at different moments
        await asyncio.sleep(0.2)
        last.move_to_epoch(4)
        await asyncio.sleep(0.2)
        first.move_to_epoch(4)

    try:
        switching = asyncio.create_task(switch())
        stats = await first.train(stream)
        await switching
        assert stats.completed == 60
        assert all(s.stats.dropped == 0 for s in services)
        assert all(s.stats.refused == 0 for s in services)
        assert all(s.failure is None for s in services)
        assert all(s.epoch == 4 for s in services)
        # every stage learned that its neighbours take epoch 4 (messages or heartbeat probes)
        await wait_until(
            lambda: first.epochs.for_peer("p1") == 4 and last.epochs.for_peer("p1") == 4, 5, message="probe"
        )
        assert middle.epochs.for_peer("p0") == 4
        assert middle.epochs.for_peer("p2") == 4
        assert all(s.executor.num_steps == 60 for s in services)
    finally:
        for s in services:
            await s.aclose()


async def test_outsiders_and_newer_epochs_are_refused_during_a_switch():
    net = FakeNetwork()
    services = await make_cluster(net, 2, window=2, heartbeat_period_s=0.05)
    first, last = services
    outsider = RpcEndpoint(net.create("x"), "t")
    try:
        last.move_to_epoch(4)
        # an outsider is refused whatever the epoch
        for epoch in (3, 4):
            with pytest.raises(RemoteError):
                await outsider.call("p1", PING, PingRequest(epoch=epoch), timeout_s=2.0)
        # the first stage has not switched: a ping of epoch 4 from the last stage is stale there
        with pytest.raises(RemoteError) as stale:
            await last.rpc.call("p0", PING, PingRequest(epoch=4), timeout_s=2.0)
        assert stale.value.code == "stale_epoch"
        # the last stage refuses an epoch newer than its own, even from its neighbour
        x, y = batches()[0]
        request = ForwardRequest(epoch=5, micro_batch_id=0, weight_version=0)
        with pytest.raises(RemoteError) as newer:
            await first.rpc.call("p1", FORWARD, request, tensors=[x, y], timeout_s=2.0)
        assert newer.value.code == "stale_epoch"
    finally:
        for s in services:
            await s.aclose()


async def test_a_first_stage_that_starts_again_on_a_plan_the_others_moved_to_in_place_numbers_on():
    # the first stage had run out of data as the plan changed, so it could not move in place: it runs
    # again (a new service, ids from 0) beside the rest of its cluster, which moved in place and still
    # holds the ids it took; READY tells the first stage where to number from, or every micro-batch
    # would be refused as a replay (a lab run stalled so)
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=3, heartbeat_period_s=0.05)
    first, middle, last = services
    again = None
    try:
        assert (await first.train(batches())).completed == 10
        await first.aclose()
        middle.move_to_epoch(4)
        last.move_to_epoch(4)
        again = StageService(
            first.rpc,
            build_stage(JOB, *even_split(num_layers(JOB), 3)[0], max_in_flight=3),
            epoch=4,
            cluster_peers=["p0", "p1", "p2"],
            stage_index=0,
            config=PipelineConfig(max_in_flight=3, send_attempts=1, send_timeout_s=1.0),
        )
        await again.start()
        await again.wait_ready(timeout_s=5.0)
        stats = await again.train(batches())
        assert stats.completed == 10
        assert middle.stats.refused == 0
        assert last.stats.refused == 0
        assert last.executor.num_steps == 20
    finally:
        for s in (again, middle, last):
            if s is not None:
                await s.aclose()
