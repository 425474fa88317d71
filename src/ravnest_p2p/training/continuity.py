"""Which clusters keep training through a re-plan: the in-place decision, pure and in one place.

Problem: a new plan used to stop and restart every stage of every cluster, although a peer joining or
leaving usually changes one cluster. Restarting costs the untouched clusters about a second plus the
hand-over and the resumption's evaluation per re-plan (more on a busy host), and in the meantime their
micro-batches stop.

Rule: a cluster is *unchanged* when the new plan has a cluster with the same peers in the same order and
the same layer ranges. Its cluster index, the number of clusters, the replica set (the other clusters)
and so the data shard and final step may change; its pipeline does not. Each of its stages then moves
its running stage to the new role in place (`StageRunner.rebase`): same weights, same micro-batches in
flight; the epoch-dependent parts switch (pipeline epoch, averaging rings, progress and metrics keys,
data shard, last step). Every peer of the cluster decides from the same (old role, new plan), so all of
its stages decide alike. Any other change (a peer, the order, a boundary) takes the hand-over path.
"""

from __future__ import annotations

from ravnest_p2p.planning import Plan
from ravnest_p2p.training.job import StagePlacement
from ravnest_p2p.training.placement import assignment_from_plan
from ravnest_p2p.training.role import Assignment, StageRole

__all__ = ["continues_in_place", "stays_in_place", "unchanged_cluster"]


def _shape(stages: tuple[StagePlacement, ...]) -> tuple[tuple[str, int, int], ...]:
    return tuple((s.peer_id, s.first_layer, s.end_layer) for s in stages)


def unchanged_cluster(old: StageRole, assignment: Assignment) -> int | None:
    """The index of `assignment`'s cluster that is `old`'s cluster unchanged (same ordered peers and
    layer ranges), or None when the cluster changed or is gone."""
    mine = _shape(old.stages)
    for index, stages in enumerate(assignment):
        if _shape(stages) == mine:
            return index
    return None


def stays_in_place(old: StageRole, plan: Plan, peer_id: str) -> bool:
    """Whether `peer_id`, running `old` on the agreed plan, keeps its stage running on `plan`."""
    if not old.on_agreed_plan or old.peer_id != peer_id or plan.epoch <= old.epoch:
        return False
    return unchanged_cluster(old, assignment_from_plan(plan)) is not None


def continues_in_place(old: StageRole, new: StageRole | None) -> bool:
    """Whether a running `old` moves to `new` in place (`new` computed by `role_for` on the new plan).

    Both on the agreed plan, the same job and peer, a newer epoch, and `old`'s cluster unchanged in the
    new plan at `new`'s place (so the same stage index, layers and window).
    """
    if new is None or not (old.on_agreed_plan and new.on_agreed_plan):
        return False
    if (old.job_id, old.peer_id) != (new.job_id, new.peer_id) or new.epoch <= old.epoch:
        return False
    return (
        unchanged_cluster(old, new.assignment) == new.cluster_index
        and new.stage_index == old.stage_index
        and new.window == old.window
    )
