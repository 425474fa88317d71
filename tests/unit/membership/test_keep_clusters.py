"""Re-plans over the membership service keep the clusters still whole, newcomers included.

The records play the node's part: after each agreed plan every peer re-announces its position and
`placement()` (as `node._make_record` does on each plan change), and the next plan is computed from them.
"""

import random

from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.membership import MembershipService, MemoryPlanBoard
from ravnest_p2p.planning import JobParams, Plan
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from tests.unit.membership.test_service import CONFIG, Clock, Records, agreed, record, run_until

KEEP = CONFIG.model_copy(update={"job": JobParams(micro_batch_size=32, min_stages=3)})
NAMES = "abcdefghijkmnopqrstuvwxyz"


def _shapes(plan: Plan) -> set[tuple[tuple[str, int, int], ...]]:
    return {
        tuple((s.peer_id, s.first_layer, s.last_layer_exclusive) for s in c.stages) for c in plan.clusters
    }


class Swarm:
    def __init__(self, config=KEEP) -> None:
        self.config = config
        self.net, self.records, self.board, self.clock = FakeNetwork(), Records(), MemoryPlanBoard(), Clock()
        self.services: dict[str, MembershipService] = {}

    async def add(self, i: int) -> str:
        pid = f"QmTestPeer{NAMES[i]}"
        self.records.all[pid] = record(pid, i)
        service = MembershipService(
            self.config,
            RpcEndpoint(self.net.create(pid), "run"),
            self.records,
            self.board.view_as(pid),
            clock=self.clock,
            rng=random.Random(i),
        )
        await service.serve()
        self.services[pid] = service
        return pid

    def kill(self, pid: str) -> None:
        del self.records.all[pid]
        self.net.kill(pid)
        self.services.pop(pid)

    def announce(self) -> None:
        """Every peer re-announces its record with its place in its active plan."""
        for pid, service in self.services.items():
            epoch, cluster, stage = service.position()
            self.records.all[pid] = self.records.all[pid].model_copy(
                update={
                    "epoch": epoch,
                    "cluster": cluster,
                    "stage": stage,
                    "placement": service.placement(),
                    "updated_at": self.records.all[pid].updated_at + 1,
                }
            )

    def plan(self) -> Plan:
        plan = next(iter(self.services.values())).active_plan
        assert plan is not None
        return plan

    async def agree_past(self, epoch: int) -> Plan:
        services = self.services
        await run_until(
            self.clock, services, lambda: agreed(services) and self.plan().epoch > epoch, max_rounds=60
        )
        self.announce()
        return self.plan()


async def test_a_kill_keeps_the_other_cluster_and_a_newcomer_agrees_on_the_kept_plan():
    swarm = Swarm()
    for i in range(8):
        await swarm.add(i)
    first = await swarm.agree_past(-1)
    assert [len(c.stages) for c in first.clusters] == [4, 4]
    assert all(r.placement is not None for r in swarm.records.all.values())

    # (with plans from scratch, this kill's re-plan and the next join's keep no cluster: checked)
    victim = sorted(pid for c in first.clusters for pid in c.peer_ids)[4]
    swarm.kill(victim)
    second = await swarm.agree_past(first.epoch)
    (other,) = (c for c in first.clusters if victim not in c.peer_ids)
    assert _shapes(first) & _shapes(second) == {
        tuple((s.peer_id, s.first_layer, s.last_layer_exclusive) for s in other.stages)
    }
    assert [len(c.stages) for c in second.clusters] in ([4, 3], [3, 4])

    # a newcomer never saw either plan: it reads the placements from the records and agrees
    newcomer = await swarm.add(9)
    third = await swarm.agree_past(second.epoch)
    assert newcomer in {pid for c in third.clusters for pid in c.peer_ids} | set(third.spare_peer_ids)
    assert len(_shapes(second) & _shapes(third)) >= 1
    assert swarm.services[newcomer].active_plan == third


async def test_without_keeping_the_plan_is_the_fresh_one():
    swarm = Swarm(KEEP.model_copy(update={"keep_clusters": False}))
    for i in range(7):
        await swarm.add(i)
    first = await swarm.agree_past(-1)
    swarm.kill(first.clusters[0].peer_ids[0])
    await swarm.agree_past(first.epoch)
    service = next(iter(swarm.services.values()))
    assert service.previous_placements() == []


def test_placements_from_other_workloads_or_this_epoch_are_ignored():
    from ravnest_p2p.discovery.records import PlacementRecord
    from ravnest_p2p.membership.placements import previous_placements

    def rec(pid: str, epoch: int, workload: str) -> PeerRecord:
        return record(pid, 0).model_copy(
            update={
                "epoch": epoch,
                "cluster": 0,
                "stage": 0,
                "placement": PlacementRecord(workload=workload, first_layer=0, last_layer_exclusive=5),
            }
        )

    records = {
        "QmTestPeera": rec("QmTestPeera", 3, "job"),
        "QmTestPeerb": rec("QmTestPeerb", 4, "job"),  # already on the epoch being planned
        "QmTestPeerc": rec("QmTestPeerc", 3, "other"),  # another job's plan
        "QmTestPeerd": rec("QmTestPeerd", 3, "job"),  # not live
    }
    live = {"QmTestPeera", "QmTestPeerb", "QmTestPeerc"}
    placed = previous_placements(records, live, workload="job", epoch=4)
    assert [p.peer_id for p in placed] == ["QmTestPeera"]


class LaggingRecords:
    """One member's directory: the records of before the placements were announced, until `fresh()`."""

    def __init__(self, records, stale: dict[str, PeerRecord]) -> None:
        self.records, self.stale, self.fresh = records, stale, lambda: False
        self._held = dict(stale)

    @property
    def peers(self) -> dict[str, PeerRecord]:
        return dict(self._held)

    async def refresh(self) -> dict[str, PeerRecord]:
        if self.fresh():
            self._held = dict(self.records.all)
        else:  # a stale replica: the old copies of the peers still there
            self._held = {pid: rec for pid, rec in self.stale.items() if pid in self.records.all}
        return dict(self._held)


async def test_a_member_that_proposed_from_stale_placements_proposes_again_in_the_same_epoch():
    # a lab join ended its epochs split ("members disagree on epoch N's plan", a new epoch each time):
    # the placements the planner keeps are outside the view digest, so a member whose directory still
    # held records from before the placements were announced proposed a plan of its own until timeout
    swarm = Swarm()
    for i in range(8):
        await swarm.add(i)
    before = dict(swarm.records.all)
    first = await swarm.agree_past(-1)
    laggard_id = sorted(swarm.services)[0]
    laggard = swarm.services[laggard_id]
    lagging = LaggingRecords(swarm.records, before)
    laggard._records = lagging
    # fresh again once it proposed epoch first + 1's plan from the old records
    lagging.fresh = lambda: laggard.tracker.epoch > first.epoch and laggard.tracker.phase == "proposed"

    # the kill of the first test: a plan from scratch keeps no cluster
    victim = sorted(pid for c in first.clusters for pid in c.peer_ids)[4]
    assert victim != laggard_id
    swarm.kill(victim)
    second = await swarm.agree_past(first.epoch)
    assert second.epoch == first.epoch + 1  # agreed in the epoch the kill opened, not one split later
    (other,) = (c for c in first.clusters if victim not in c.peer_ids)
    kept = tuple((s.peer_id, s.first_layer, s.last_layer_exclusive) for s in other.stages)
    assert kept in _shapes(second)


async def test_members_that_activate_first_and_re_announce_do_not_split_the_epoch():
    # a lab kill: the first members to activate epoch E's plan re-announced their new places at once,
    # which E's planning leaves out; the members still proposing lost those placements, proposed again
    # with a plan that kept nothing, and the epoch ended split (20 s, past the 30 s resume goal)
    swarm = Swarm()
    for i in range(8):
        await swarm.add(i)
    first = await swarm.agree_past(-1)
    victim = sorted(pid for c in first.clusters for pid in c.peer_ids)[4]
    swarm.kill(victim)

    def announce_if_active(pid: str) -> None:  # what the node does as soon as its plan changes
        service = swarm.services[pid]
        if service.active_plan is not None and service.active_plan.epoch > first.epoch:
            epoch, cluster, stage = service.position()
            rec = swarm.records.all[pid]
            if rec.epoch != epoch:
                swarm.records.all[pid] = rec.model_copy(
                    update={
                        "epoch": epoch,
                        "cluster": cluster,
                        "stage": stage,
                        "placement": service.placement(),
                        "updated_at": rec.updated_at + 1,
                    }
                )

    for _ in range(60):
        swarm.clock.now += 1.0
        for pid, service in swarm.services.items():
            await service.step()
            announce_if_active(pid)
        if agreed(swarm.services) and swarm.plan().epoch > first.epoch:
            break
    second = swarm.plan()
    assert agreed(swarm.services)
    assert second.epoch == first.epoch + 1
    (other,) = (c for c in first.clusters if victim not in c.peer_ids)
    assert tuple((s.peer_id, s.first_layer, s.last_layer_exclusive) for s in other.stages) in _shapes(second)
