"""How a member proposes its epoch's plan and sees it agreed (a mixin; `membership.agreement` owns the state).

When the `EpochTracker` asks for a proposal: compute ``make_plan`` on the compute thread over a snapshot
of the view (dropped if the view, epoch or workload moved meanwhile), keep the previous plan's whole
clusters (`previous_placements`), publish the plan's digest on the board, and read the board until
every member the plan names published the same digest: then the plan is active and listeners hear of
it. A member whose kept placements changed under its proposal proposes again in the same epoch; on the
agreement timeout, silent members are excluded, and members that all spoke but disagree open the next
epoch.

Why separate: `agreement.py` holds the service's round, its epochs and its suspects; proposing and
agreeing on one plan is this mixin, with the link matrix the plan is computed from (`view_links`), so
each module stays small. `MembershipService` declares and owns every attribute listed here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ravnest_p2p.membership.board import PlanBoard
from ravnest_p2p.membership.config import MembershipConfig
from ravnest_p2p.membership.epochs import EpochTracker, Phase
from ravnest_p2p.membership.exclusions import Exclusions
from ravnest_p2p.membership.placements import PlacementMemory
from ravnest_p2p.membership.view import Capacity, MembershipView
from ravnest_p2p.planning import LinkMatrix, PeerCapacity, PlacedStage, Plan, make_plan
from ravnest_p2p.planning.memory import memory_shortfall
from ravnest_p2p.utils import run_in_compute_thread

if TYPE_CHECKING:
    from ravnest_p2p.membership.agreement import RecordSource

__all__ = ["PlanProposals", "view_links"]

logger = logging.getLogger(__name__)


def view_links(live: dict[str, Capacity], peers: list[PeerCapacity]) -> LinkMatrix:
    """The link matrix of the view's live peers, from their bucketed link reports."""
    return LinkMatrix.build(peers, {pid: cap.link_reports() for pid, cap in live.items()})


class _Stale(Exception):
    pass


def _plan_members(plan: Plan) -> frozenset[str]:
    return frozenset([pid for c in plan.clusters for pid in c.peer_ids] + list(plan.spare_peer_ids))


class PlanProposals:
    """The proposing and agreeing half of `MembershipService` (which owns the state declared here)."""

    config: MembershipConfig
    peer_id: str
    tracker: EpochTracker
    view: MembershipView
    exclusions: Exclusions
    workload: str
    active_plan: Plan | None
    active_workload: str | None
    plan_changed: asyncio.Event
    _records: RecordSource
    _board: PlanBoard
    _proposal: Plan | None
    _proposal_workload: str
    _proposal_placements: list[PlacedStage]
    _placements: PlacementMemory
    _published_at: float
    _refresh_wanted: bool
    _listeners: list[Callable[[Plan], None]]

    async def _repropose_if_placements_moved(self, now: float) -> None:
        """Propose again, in the same epoch and agreement deadline, if what the plan keeps changed.

        The placements the planner keeps come from the members' records, outside the view digest: a
        member that proposed from a record read before a peer announced its placement proposes another
        plan than the rest, and the epoch used to end split ("members disagree", a new epoch). The
        disagreement makes it re-read the records (`_check_agreement`); this makes it propose from them.
        A member that activated first and re-announced keeps, here, the placement it had before
        (`previous_placements`), so it does not send the others back to proposing.
        """
        if self.previous_placements() == self._proposal_placements:
            return
        deadline_from = self.tracker.proposed_at
        logger.info("placements changed under epoch %d's proposal: proposing again", self.tracker.epoch)
        await self._propose(now)
        if self.tracker.phase == Phase.PROPOSED:
            self.tracker.proposed_at = deadline_from  # the agreement timeout still runs from the first

    def _plan_inputs(self) -> tuple[list[PeerCapacity], LinkMatrix | None]:
        live = self.view.live()
        peers = [cap.to_peer_capacity(pid) for pid, cap in live.items()]
        return peers, view_links(live, peers) if self.config.plan_with_links else None

    def previous_placements(self) -> list[PlacedStage]:
        """What the plan of this epoch keeps: the live peers' placements (`membership.placements`)."""
        if not self.config.keep_clusters:
            return []
        return self._placements.kept(
            self._records.peers, self.view.live_ids(), workload=self.workload, epoch=self.tracker.epoch
        )

    def compute_plan(self) -> Plan:
        """The plan of the current view and epoch (live peers sorted by id; pure)."""
        peers, links = self._plan_inputs()
        return make_plan(
            peers,
            self.config.layers,
            self.config.job,
            epoch=self.tracker.epoch,
            links=links,
            previous=self.previous_placements(),
        )

    async def _compute_plan_off_loop(self) -> tuple[Plan, list[PlacedStage]]:
        # make_plan grows super-linearly (~15 s for 100 peers on this machine): run it on the compute
        # thread over a snapshot taken here, so the loop keeps gossiping and the view cannot race it.
        peers, links = self._plan_inputs()
        previous = self.previous_placements()
        epoch, digest, workload = self.tracker.epoch, self.view.digest(), self.workload
        plan = await run_in_compute_thread(
            make_plan, peers, self.config.layers, self.config.job, epoch=epoch, links=links, previous=previous
        )
        if (epoch, digest, workload) != (self.tracker.epoch, self.view.digest(), self.workload):
            raise _Stale()
        return plan, previous

    async def _publish(self, now: float) -> None:
        assert self._proposal is not None
        digest = self._proposal.digest()
        try:
            await asyncio.wait_for(
                self._board.publish(self.tracker.epoch, digest, ttl_s=self.config.plan_ttl_s),
                self.config.call_timeout_s,
            )
            self._published_at = now
        except (TimeoutError, OSError) as exc:
            logger.warning("could not publish the plan digest: %r", exc)

    async def _propose(self, now: float) -> None:
        try:
            plan, kept = await self._compute_plan_off_loop()
        except _Stale:
            return  # the view or epoch moved while we computed: the tracker will ask again
        except ValueError as exc:
            logger.warning("cannot plan epoch %d: %s", self.tracker.epoch, exc)
            return
        if self.peer_id not in _plan_members(plan):
            return  # we are not in our own view yet (record not announced): wait
        self._proposal = plan
        self._proposal_workload = self.workload
        self._proposal_placements = kept
        self.tracker.proposed(now, _plan_members(plan))
        await self._publish(now)
        logger.debug("proposed plan %s for epoch %d", plan.digest()[:12], plan.epoch)

    async def _read_board(self) -> dict[str, str] | None:
        return await self._read_board_at(self.tracker.epoch)

    async def _read_board_at(self, epoch: int) -> dict[str, str] | None:
        try:
            return await asyncio.wait_for(self._board.read(epoch), self.config.call_timeout_s)
        except (TimeoutError, OSError) as exc:
            logger.debug("could not read the plan board: %r", exc)
            return None

    async def _check_agreement(self) -> None:
        published = await self._read_board()
        if published is None or self._proposal is None:
            return
        digest = self._proposal.digest()
        if all(published.get(pid) == digest for pid in self.tracker.members):
            self.tracker.activated()
            self.active_plan = self._proposal
            self.active_workload = self._proposal_workload
            logger.info(
                "plan %s active for epoch %d: %d clusters, %d spares",
                digest[:12],
                self._proposal.epoch,
                len(self._proposal.clusters),
                len(self._proposal.spare_peer_ids),
            )
            if not self._proposal.clusters:
                peers, _ = self._plan_inputs()
                why = memory_shortfall(peers, self.config.layers, self.config.job)
                logger.warning(
                    "the plan has no cluster: %s", why or "no cluster of the members can hold the model"
                )
            self.plan_changed.set()
            self.plan_changed = asyncio.Event()
            for callback in self._listeners:
                callback(self._proposal)
        elif any(published.get(pid, digest) != digest for pid in self.tracker.members):
            self._refresh_wanted = True  # someone sees another view: re-read the records

    async def _on_timeout(self, now: float) -> None:
        published = await self._read_board() or {}
        silent = self.tracker.members - set(published) - {self.peer_id}
        if silent:
            logger.info("dropping %d members silent on epoch %d", len(silent), self.tracker.epoch)
            for pid in silent:
                self.exclusions.exclude(pid, may_return=True)
            self.tracker.open_epoch(self.tracker.epoch + 1)
        elif self._proposal is not None and any(
            published.get(pid) != self._proposal.digest() for pid in self.tracker.members
        ):
            # everyone spoke but not alike: some member may already have activated this epoch's plan
            # (it saw an earlier round of digests agree) and will never propose again here; only a new
            # epoch, which gossip carries to it, brings every member back to proposing
            logger.info("members disagree on epoch %d's plan: opening the next epoch", self.tracker.epoch)
            self.tracker.open_epoch(self.tracker.epoch + 1)
        else:
            self.tracker.retry(now)
