"""`MembershipService`: from signed records to one agreed plan per epoch.

Each round (``gossip_period_s``): (1) rebuild the view from our own validated directory snapshot, the
only source of records we trust (re-read at once when gossip brought news); (2) gossip with a random
fanout; (3) let the `EpochTracker` decide; (4) when it says so, compute ``make_plan(view, job, epoch)``
over the live peers sorted by id, publish the digest under ``plan/<epoch>``, and watch the board until
every member the plan names published the same digest: then the plan is *active* and listeners hear of
it. The plan keeps the previous plan's clusters that are still whole (`planning.replan`), read from the
placements in the live members' signed records (`membership.placements`). Proposing and agreeing is the
`PlanProposals` half (`membership.proposals`). Members silent past ``agreement_timeout_s`` are excluded
for ``exclude_for_s`` and a new epoch opens without them (a peer that runs no membership service would
otherwise block agreement forever).

Faults: a heard epoch is adopted only when members' signed records back it (`epochs.backed_epoch`;
strangers' claims are dropped, and strangers' gossip is rate-limited). `report_suspect` verifies a
suspect by our own ping and, if it is dead, excludes it and opens a new epoch at once when it is in the
active plan, then publishes a signed `SuspectReport` so other members verify and exclude it as fast
(`membership.suspects`). That beats waiting for the dead peer's record to expire by tens of seconds.

Limits: exclusion is each peer's own reading of the board, so two peers may exclude different sets
for a round; their view digests then differ, gossip shows it, and the next stable round re-proposes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ravnest_p2p.discovery import PeerRecord, RunDHT, dht_time
from ravnest_p2p.discovery.records import PlacementRecord, Serving
from ravnest_p2p.membership.board import PlanBoard
from ravnest_p2p.membership.config import DEFAULT_LAYERS, MembershipConfig
from ravnest_p2p.membership.epochs import Action, EpochTracker, Phase, backed_epoch
from ravnest_p2p.membership.exclusions import Exclusions
from ravnest_p2p.membership.gossip import Gossiper, GossipLimits
from ravnest_p2p.membership.placements import PlacementMemory, own_placement
from ravnest_p2p.membership.proposals import PlanProposals, view_links
from ravnest_p2p.membership.suspects import DhtSuspectBoard, SuspectBoard, SuspectKind
from ravnest_p2p.membership.suspicion import SuspicionKeeper
from ravnest_p2p.membership.view import Capacity, MembershipView, SummaryItem
from ravnest_p2p.planning import JobParams, PlacedStage, Plan
from ravnest_p2p.transport import RpcEndpoint
from ravnest_p2p.types import LayerProfile, PeerState

__all__ = [
    "DEFAULT_LAYERS",
    "MembershipConfig",
    "MembershipService",
    "RecordSource",
    "plan_neighbours",
    "plan_position",
    "view_links",
]

logger = logging.getLogger(__name__)


class RecordSource(Protocol):
    """Validated records by peer id (`discovery.PeerDirectory` is one)."""

    @property
    def peers(self) -> dict[str, PeerRecord]: ...

    async def refresh(self) -> dict[str, PeerRecord]: ...


def plan_position(plan: Plan | None, peer_id: str) -> tuple[int | None, int | None]:
    """(cluster index, stage index) of ``peer_id`` in ``plan``; (None, None) for spares and outsiders."""
    if plan is not None:
        for cluster in plan.clusters:
            for stage, assignment in enumerate(cluster.stages):
                if assignment.peer_id == peer_id:
                    return cluster.index, stage
    return None, None


def plan_neighbours(plan: Plan | None, peer_id: str) -> frozenset[str]:
    """The peers whose links to ``peer_id`` the plan depends on.

    Its pipeline neighbours (the stages before and after it) and, for averaging, the peers holding
    the same stage in the clusters before and after its own (by cluster index, wrapping): the ring's
    neighbours when clusters are ringed in index order, a stand-in otherwise.
    """
    cluster, stage = plan_position(plan, peer_id)
    if plan is None or cluster is None or stage is None:
        return frozenset()
    stages = plan.clusters[cluster].stages
    out = {stages[j].peer_id for j in (stage - 1, stage + 1) if 0 <= j < len(stages)}
    peers = [c.stages[stage].peer_id for c in plan.clusters if stage < len(c.stages)]
    if len(peers) > 1:
        mine = peers.index(peer_id)
        out |= {peers[(mine - 1) % len(peers)], peers[(mine + 1) % len(peers)]}
    out.discard(peer_id)
    return frozenset(out)


def record_capacity(record: PeerRecord) -> Capacity:
    return Capacity.from_figures(
        flops=record.flops,
        memory_bytes=record.free_memory_bytes,
        upload_mbps=record.upload_mbps,
        download_mbps=record.download_mbps,
        links=[(link.peer_id, link.up_mbps, link.down_mbps, link.rtt_ms) for link in record.links],
    )


class MembershipService(PlanProposals):
    """Gossip + epochs + plan agreement for one peer. Owners run `serve()`, then `run()` as a task."""

    def __init__(
        self,
        config: MembershipConfig,
        rpc: RpcEndpoint,
        records: RecordSource,
        board: PlanBoard,
        *,
        suspects: SuspectBoard | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = dht_time,
    ) -> None:
        self.config = config
        self.peer_id = rpc.peer_id
        self._records = records
        self._board = board
        self._clock = clock
        self._wall_clock = wall_clock
        self.view = MembershipView(num_buckets=config.num_buckets)
        self.tracker = EpochTracker(config.timing())
        self.gossiper = Gossiper(
            rpc,
            self.view,
            get_epoch=lambda: self.tracker.epoch,
            on_epoch=self._heard_epoch,
            on_news=self._heard_news,
            fanout=config.fanout,
            call_timeout_s=config.call_timeout_s,
            rng=rng,
            limits=GossipLimits().scaled(config.gossip_period_s),
            is_member=self._is_member,
            clock=clock,
            get_suspects_version=lambda: self.suspicion.version,
            on_suspects_version=lambda sender, version: self.suspicion.heard_version(sender, version),
        )
        # (claimant -> highest epoch it claimed) since the last round; adopted only when backed
        self._claims: dict[str, int] = {}
        self.num_epoch_claims_dropped = 0
        if suspects is None and isinstance(getattr(board, "_dht", None), RunDHT):
            # until the composition root passes a board: reports go where the plan digests go
            suspects = DhtSuspectBoard(board._dht)  # type: ignore[attr-defined]
        self.suspicion = SuspicionKeeper(
            rpc,
            suspects,
            call_timeout_s=config.call_timeout_s,
            report_ttl_s=config.suspect_report_ttl_s,
            exclude=self._exclude,
            is_excluded=self._is_excluded,
            is_member=self._is_member,
            are_neighbours=self._are_neighbours,
            get_epoch=lambda: self.tracker.epoch,
            clock=wall_clock,
            read_period_s=max(1.0, config.gossip_period_s),
            monotonic=clock,
        )
        self.active_plan: Plan | None = None
        # which workload (e.g. a job id) the plans are for: every peer that sees the same job sets the
        # same workload, so their plans agree; `active_workload` is what the active plan was made for
        self.workload = "default"
        self.active_workload: str | None = None
        self._proposal: Plan | None = None
        self._proposal_workload = "default"
        # the previous placements the proposal kept (`previous_placements`): not in the view digest
        self._proposal_placements: list[PlacedStage] = []
        self._placements = PlacementMemory()  # what each epoch's planning keeps (`previous_placements`)
        # what the workload needs of a peer (its plugins): peers whose records lack it are not planned
        self._serving: Serving | None = None
        # dead, silent or misbehaving peers left out of the view (`exclusions.py`)
        self.exclusions = Exclusions(config.exclude_for_s, clock=clock, wall_clock=wall_clock)
        self._refresh_wanted = False
        self._published_at = -1e18
        self._listeners: list[Callable[[Plan], None]] = []
        self.plan_changed = asyncio.Event()
        self.num_rounds = 0

    @property
    def epoch(self) -> int:
        return self.tracker.epoch

    @property
    def phase(self) -> Phase:
        return self.tracker.phase

    def add_listener(self, callback: Callable[[Plan], None]) -> None:
        """Call ``callback(plan)`` each time a new plan becomes active."""
        self._listeners.append(callback)

    def position(self) -> tuple[int, int | None, int | None]:
        """(epoch, cluster, stage) of this peer in the active plan, for its `PeerRecord`."""
        cluster, stage = plan_position(self.active_plan, self.peer_id)
        epoch = self.active_plan.epoch if self.active_plan is not None else 0
        return epoch, cluster, stage

    def placement(self) -> PlacementRecord | None:
        """This peer's layers in the active plan, for its `PeerRecord` (`membership.placements`)."""
        return own_placement(self.active_plan, self.active_workload, self.peer_id)

    def set_workload(
        self, key: str, job: JobParams, layers: Sequence[LayerProfile], *, serving: Serving | None = None
    ) -> None:
        """Plan for another workload (a job's micro-batch size and layer profile) from a new epoch on.

        Peers learn the job on their own schedule, so a peer may move to the new epoch twice (once when
        it hears a peer that already moved, once when it reads the job itself); the highest epoch wins
        and plans made before every member knows the job never gather all digests. `serving` leaves out
        the peers whose records do not serve the job (a plugin they lack, or they said they cannot).
        """
        if key == self.workload:
            return
        self.config = self.config.model_copy(update={"job": job, "layers": tuple(layers)})
        self.workload = key
        self._serving = serving
        self.tracker.open_epoch(self.tracker.epoch + 1)
        logger.info("planning for workload %s from epoch %d", key, self.tracker.epoch)

    # ----- epochs and suspects (faults) -------------------------------------------------------------
    def _is_member(self, peer_id: str) -> bool:
        """A live member: a valid signed record in our directory, eligible, not excluded."""
        return peer_id in self.view.live_ids()

    def _is_excluded(self, peer_id: str) -> bool:
        return self.exclusions.is_excluded(peer_id)

    def _are_neighbours(self, a: str, b: str) -> bool:
        (cluster_a, stage_a), (cluster_b, stage_b) = (plan_position(self.active_plan, p) for p in (a, b))
        if cluster_a is None or cluster_a != cluster_b or stage_a is None or stage_b is None:
            return False
        return abs(stage_a - stage_b) == 1

    def _heard_epoch(self, sender: str, epoch: int) -> None:
        if not self._is_member(sender):
            self.num_epoch_claims_dropped += 1
            logger.debug("dropped epoch %d claimed by %s, not a live member", epoch, sender)
            return
        self._claims[sender] = max(epoch, self._claims.get(sender, 0))

    async def _adopt_claims(self) -> None:
        claims = {p: e for p, e in self._claims.items() if e > self.tracker.epoch and self._is_member(p)}
        self._claims.clear()
        if not claims:
            return
        claimant, claim = max(claims.items(), key=lambda item: (item[1], item[0]))
        live = self.view.live_ids()
        record_epochs = [rec.epoch for pid, rec in self._records.peers.items() if pid in live]
        if claim > max(record_epochs, default=0) + 1:
            by_other = False
            for epoch in (claim - 1, claim):  # a board keeping each member's latest digest may show E only
                published = await self._read_board_at(epoch) or {}
                by_other = any(pid in live and pid != claimant for pid in published)
                if by_other:
                    break
        else:
            by_other = False
        target = backed_epoch(claim, record_epochs=record_epochs, previous_published_by_other=by_other)
        if target < claim:
            self.num_epoch_claims_dropped += 1
            logger.info("epoch %d claimed by %s is not backed (bound %d)", claim, claimant, target)
        if self.tracker.open_epoch(target):
            logger.debug("moved to epoch %d heard from %s", target, claimant)

    def report_suspect(self, peer_id: str, reason: str) -> None:
        """Suspect ``peer_id`` (e.g. a stage failed with `NeighbourLost`); returns at once.

        Within a round we ping it ourselves; only if it does not answer is it excluded for
        ``exclude_for_s`` (a new epoch opens at once if it is in the active plan) and reported to the
        other members under ``suspects``, who verify it the same way.
        """
        self.suspicion.report(peer_id, reason)

    def report_misbehaviour(self, peer_id: str, reason: str) -> None:
        """Our own `PeerLedger` excluded ``peer_id``: exclude it (our evidence) and report it as a witness."""
        self.suspicion.report(peer_id, reason, kind=SuspectKind.MISBEHAVING)

    def _exclude(self, peer_id: str, reason: str) -> None:
        misbehaving = reason.startswith(f"{SuspectKind.MISBEHAVING}:")
        self.exclusions.exclude(peer_id, may_return=not misbehaving)
        self._claims.pop(peer_id, None)
        logger.warning("excluding %s for %.0fs: %s", peer_id, self.config.exclude_for_s, reason)
        if peer_id in self.tracker.members and self.tracker.phase == Phase.ACTIVE:
            self.tracker.open_epoch(self.tracker.epoch + 1)
            logger.info("a member of the active plan is excluded: opening epoch %d", self.tracker.epoch)

    def _heard_news(self, sender: str, items: list[SummaryItem]) -> None:
        logger.debug("%d news items from %s: re-reading records", len(items), sender)
        self._refresh_wanted = True

    async def serve(self) -> None:
        await self.gossiper.serve()
        await self.suspicion.serve()

    async def aclose(self) -> None:
        await self.gossiper.unserve()
        await self.suspicion.unserve()

    def _eligible(self, record: PeerRecord) -> bool:
        if record.state not in (PeerState.READY, PeerState.TRAINING) or record.client_mode:
            return False
        if self._serving is not None and not self._serving.met_by(record):
            return False
        return self.exclusions.admits(record)

    async def _observe(self, now: float) -> None:
        if self._refresh_wanted:
            self._refresh_wanted = False
            try:
                await asyncio.wait_for(self._records.refresh(), self.config.call_timeout_s)
            except (TimeoutError, OSError) as exc:
                logger.debug("record refresh failed: %r", exc)
        snapshot = {
            pid: (rec.updated_at, record_capacity(rec))
            for pid, rec in self._records.peers.items()
            if self._eligible(rec)
        }
        self.view.observe(snapshot)

    async def step(self) -> None:
        """One round: observe, gossip, decide, act."""
        now = self._clock()
        self.num_rounds += 1
        await self.suspicion.step()
        await self._observe(now)
        await self._adopt_claims()
        candidates = sorted(self.view.live_ids() - {self.peer_id})
        if candidates:
            await self.gossiper.gossip_round(candidates)
        action = self.tracker.tick(now, self.view.digest(), self.view.live_ids())
        if action == Action.NEW_EPOCH:
            logger.info("membership changed: opening epoch %d", self.tracker.epoch)
        elif action == Action.PROPOSE:
            await self._propose(now)
        elif action == Action.TIMEOUT:
            await self._on_timeout(now)
        if self.tracker.phase == Phase.PROPOSED:
            await self._repropose_if_placements_moved(now)
            await self._check_agreement()
        elif self.tracker.phase == Phase.ACTIVE and now - self._published_at > self.config.plan_ttl_s / 3:
            await self._publish(now)

    def probe_priority(self) -> frozenset[str]:
        """Peers whose links the current plan (active, else proposed) depends on: probe them first."""
        return plan_neighbours(self.active_plan or self._proposal, self.peer_id)

    async def run(self) -> None:
        """Step every ``gossip_period_s`` until cancelled; a failed round is logged, not fatal."""
        while True:
            started = self._clock()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a peer boundary: keep the loop alive, say why
                logger.warning("membership round failed: %r", exc, exc_info=True)
            # a fresh suspect report wakes the loop early: exclusion should not wait for the period
            with contextlib.suppress(TimeoutError):
                remaining_s = max(0.0, self.config.gossip_period_s - (self._clock() - started))
                await asyncio.wait_for(self.suspicion.wake.wait(), remaining_s)
            self.suspicion.wake.clear()
