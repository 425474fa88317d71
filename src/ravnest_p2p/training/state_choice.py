"""Where a stage's starting state comes from when a plan starts it (the supervisor's state choice).

A new plan gives this peer a role; its layers' state is, in order of preference: what this process
holds (a retry on the same plan), the previous plan's holders of those layers (freshest cluster first,
`resume.freshest_first`), the newest complete checkpoint, else the initial weights (`resume.gather_state`
walks the candidates). Three cases change whom to ask:

- a *newcomer* (no previous role here, while the job already trained: it joined mid-job or restarted)
  asks the new plan's holders of its layers, then every other live member, as they held them on the
  newest earlier plan;
- a peer whose previous plan *never trained* (no cluster published progress on it: a split vote it
  alone activated, or a pipeline that never formed) takes its state as a newcomer does: that plan's
  other "holders" never ran it, and what this peer holds may be initial weights;
- otherwise the previous plan's members are asked, and only they (`allowed`).

Why a module of its own: the choice grew with each lab failure (joins resumed layers from the initial
weights three times, for three different reasons), and it is pure policy over injected seams; the
supervisor only keeps the per-job memory it reads (held state, previous role, positions seen).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.progress import ProgressView
from ravnest_p2p.training.resume import (
    CheckpointQuery,
    HeldState,
    Segment,
    StateSource,
    freshest_first,
    gather_state,
    state_sources,
)
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.stage_state import StageState

__all__ = ["StateChoice", "never_trained"]

logger = logging.getLogger(__name__)

Origin = dict[str, str]  # where each layer span's state came from ("0-2": peer id, "checkpoint", ...)


def never_trained(
    previous: StageRole, progress: ProgressView, positions: Mapping[tuple[int, int], int]
) -> bool:
    """No cluster published progress on `previous`'s epoch (as read now, or as `positions` saw while it
    ran), while an earlier epoch did: the job's state lives on that earlier plan's holders, not here."""
    seen = set(progress.positions) | set(positions)
    epochs = {epoch for epoch, _ in seen}
    return previous.epoch not in epochs and any(epoch < previous.epoch for epoch in epochs)


@dataclass
class StateChoice:
    """The starting state of this peer's roles (see the module docstring).

    Attributes:
        peer_id: this peer.
        state_source: fetches other peers' stage state and checkpoints (None: only our own).
        alive: the peers believed alive now (None: every member of the plan asked).
        replica_tie_micro_batches: replicas within this many micro-batches of each other rank by
            cluster index (every peer then asks in the same order).
    """

    peer_id: str
    state_source: StateSource | None
    alive: Callable[[], Collection[str]] | None
    replica_tie_micro_batches: int

    async def starting_state(
        self,
        job: JobSpec,
        role: StageRole,
        progress: ProgressView | None,
        *,
        held: HeldState | None,
        previous: StageRole | None,
        positions: Mapping[tuple[int, int], int],
    ) -> tuple[StageState | None, Origin]:
        """(state, origin by layer span) for `role`; `held`/`previous`/`positions` are this process's
        memory of the job (the state it holds, the role it last ran, the positions it saw)."""
        if previous is None and role.data_start > 0 and progress is not None:
            return await self.for_a_newcomer(job, role, progress)
        if (
            previous is not None
            and previous.epoch != role.epoch
            and role.data_start > 0
            and progress is not None
            and never_trained(previous, progress, positions)
        ):
            # lab joins resumed layers from initial weights asking that plan's "holders" (loss 0.09 -> 0.76)
            logger.info(
                "job %s: epoch %d never trained here (no progress of it): state as a newcomer's",
                role.job_id,
                previous.epoch,
            )
            return await self.for_a_newcomer(job, role, progress)
        if previous is None or previous.epoch == role.epoch:
            # the job's first plan here, or a retry on the same plan (nothing moved)
            if held is not None and previous is not None and role.same_stage(previous):
                return held.state, {}
            return None, {}
        allowed = previous.plan_peers
        alive = set(self.alive()) if self.alive is not None else set(allowed)
        merged = dict(positions)
        for key, position in (progress.positions if progress is not None else {}).items():
            merged[key] = max(merged.get(key, 0), position)
        order = freshest_first(
            merged,
            epoch=previous.epoch,
            num_clusters=previous.num_clusters,
            prefer=role.cluster_index,
            tie_micro_batches=self.replica_tie_micro_batches,
        )
        segments = state_sources(previous.assignment, role, alive=alive, cluster_order=order)
        return await self._gather(job, role, segments, held, allowed, previous.epoch, "stage state")

    async def for_a_newcomer(
        self, job: JobSpec, role: StageRole, progress: ProgressView
    ) -> tuple[StageState | None, Origin]:
        """State for a peer that never ran this job here although the job already trained.

        It joined mid-job or restarted: ask the plan's other holders of its layers for them as they held
        them on the newest earlier plan, then every other live member, then the newest checkpoint; else
        the layers start from the initial weights.
        """
        earlier = [epoch for epoch, _ in progress.positions if epoch < role.epoch]
        previous_epoch = max(earlier, default=role.epoch)
        allowed = role.plan_peers - {self.peer_id}
        alive = set(self.alive()) if self.alive is not None else set(allowed)
        # by cluster index, as every peer ranks replicas within `replica_tie_micro_batches` of each other
        order = list(range(len(role.assignment)))
        segments = state_sources(role.assignment, role, alive=alive, cluster_order=order)
        # then every other live member: the plan's holders of these layers may have held others on the
        # earlier plan (their cluster re-formed), while a member now on other layers held these (a lab
        # join restarted layers from the initial weights that way); a peer without them answers empty
        others = sorted((alive & role.plan_peers) - {self.peer_id})
        segments = [
            Segment(
                s.first_layer, s.end_layer, (*s.candidates, *(p for p in others if p not in s.candidates))
            )
            for s in segments
        ]
        return await self._gather(
            job, role, segments, None, allowed, previous_epoch, "newcomer's stage state"
        )

    async def _gather(
        self,
        job: JobSpec,
        role: StageRole,
        segments: list[Segment],
        held: HeldState | None,
        allowed: frozenset[str],
        previous_epoch: int,
        what: str,
    ) -> tuple[StageState | None, Origin]:
        state, origin = await gather_state(
            role,
            segments,
            held=held,
            source=self.state_source,
            allowed=allowed,
            previous_epoch=previous_epoch,
            checkpoints=CheckpointQuery.of(job, role, allowed),
        )
        logger.info("job %s: %s from %s", role.job_id, what, origin)
        return state, origin
