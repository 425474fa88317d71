"""The membership service over the fake transport, a shared record store and an in-memory board."""

import random

from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.membership import MembershipConfig, MembershipService, MemoryPlanBoard, Phase
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.types import PeerState

CONFIG = MembershipConfig(
    gossip_period_s=1.0,
    stable_rounds=2,
    hysteresis_s=2.0,
    join_delay_s=3.0,
    grace_s=3.0,
    agreement_timeout_s=6.0,
    exclude_for_s=100.0,
)


class Records:
    """Stand-in for the directory: validated records everyone reads alike."""

    def __init__(self) -> None:
        self.all: dict[str, PeerRecord] = {}

    @property
    def peers(self) -> dict[str, PeerRecord]:
        return dict(self.all)

    async def refresh(self) -> dict[str, PeerRecord]:
        return dict(self.all)


def record(pid: str, i: int) -> PeerRecord:
    return PeerRecord(
        peer_id=pid,
        flops=1e10 * (1 + i % 3),
        free_memory_bytes=2**33,
        upload_mbps=20.0 * (1 + i % 2),
        download_mbps=100.0,
        state=PeerState.READY,
        updated_at=1000.0,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def make(num_peers: int):
    net, records, board, clock = FakeNetwork(), Records(), MemoryPlanBoard(), Clock()
    services = {}
    for i in range(num_peers):
        pid = f"QmTestPeer{'abcdefghijkmnopqrstuvwxyz'[i]}"
        records.all[pid] = record(pid, i)
        service = MembershipService(
            CONFIG,
            RpcEndpoint(net.create(pid), "run"),
            records,
            board.view_as(pid),
            clock=clock,
            rng=random.Random(i),
        )
        await service.serve()
        services[pid] = service
    return net, records, board, clock, services


async def run_until(clock, services, predicate, max_rounds=40) -> int:
    for rounds in range(1, max_rounds + 1):
        clock.now += CONFIG.gossip_period_s
        for service in services.values():
            await service.step()
        if predicate():
            return rounds
    raise AssertionError("not reached")


def agreed(services) -> bool:
    plans = [s.active_plan for s in services.values()]
    return all(p is not None for p in plans) and len({(p.epoch, p.digest()) for p in plans}) == 1


async def test_peers_agree_then_replan_after_a_departure_but_not_after_a_blip():
    net, records, board, clock, services = await make(6)
    heard = []
    next(iter(services.values())).add_listener(heard.append)
    await run_until(clock, services, lambda: agreed(services))
    first = next(iter(services.values())).active_plan
    assert first is not None
    assert first.epoch == 0
    assert heard == [first]
    assert set(board.digests[0].values()) == {first.digest()}
    epoch, cluster, stage = next(iter(services.values())).position()
    assert epoch == 0
    assert (cluster is None) == (stage is None)

    victim = sorted(services)[-1]
    blip = records.all.pop(victim)  # a blip shorter than the grace period: no new epoch
    await run_until(clock, services, lambda: True, max_rounds=2)
    records.all[victim] = blip
    await run_until(clock, services, lambda: True, max_rounds=6)
    assert all(s.epoch == 0 and s.phase == Phase.ACTIVE for s in services.values())

    del records.all[victim]
    net.kill(victim)
    services.pop(victim)
    await run_until(
        clock, services, lambda: agreed(services) and next(iter(services.values())).active_plan.epoch
    )
    second = next(iter(services.values())).active_plan
    assert second.epoch == 1
    assert victim not in str(second.model_dump())


async def test_silent_member_is_dropped_in_the_next_epoch():
    _, _, _, clock, services = await make(4)
    silent = sorted(services)[0]
    services.pop(silent)  # its record stays, but it never gossips nor publishes a digest
    await run_until(clock, services, lambda: agreed(services))
    plan = next(iter(services.values())).active_plan
    assert plan.epoch >= 1
    assert silent not in str(plan.model_dump())
