"""Placements: what a peer announces about its stage, and what the next plan reads back from records.

A re-plan keeps the previous plan's clusters that are still whole (`planning.replan`). Its input must be
the same on every member, newcomers included, which never saw the previous plan: so each peer running a
stage announces it in its signed record (the plan's epoch, cluster and stage, plus a `PlacementRecord`
with its layer range and workload), and the planner of epoch ``E`` reads those of the live peers back.

Only placements on plans of epochs before ``E`` made for the current workload count: a member that has
already activated ``E``'s plan and re-announced must not change what the members still proposing ``E``
compute, and a placement on another job's plan says nothing about this one.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.discovery.records import PlacementRecord
from ravnest_p2p.planning import PlacedStage, Plan

__all__ = ["PlacementMemory", "own_placement", "previous_placements"]


def own_placement(plan: Plan | None, workload: str | None, peer_id: str) -> PlacementRecord | None:
    """``peer_id``'s layers in ``plan`` (made for ``workload``), for its record; None for spares."""
    if plan is None or workload is None:
        return None
    for cluster in plan.clusters:
        for stage in cluster.stages:
            if stage.peer_id == peer_id:
                return PlacementRecord(
                    workload=workload,
                    first_layer=stage.first_layer,
                    last_layer_exclusive=stage.last_layer_exclusive,
                )
    return None


def previous_placements(
    records: Mapping[str, PeerRecord], live: Set[str], *, workload: str, epoch: int
) -> list[PlacedStage]:
    """The live peers' placements on plans of epochs before ``epoch`` made for ``workload``, by peer id."""
    out = []
    for pid, rec in sorted(records.items()):
        placed = rec.placement
        if pid not in live or placed is None or rec.cluster is None or rec.stage is None:
            continue
        if placed.workload != workload or rec.epoch >= epoch:
            continue
        out.append(
            PlacedStage(
                peer_id=pid,
                epoch=rec.epoch,
                cluster=rec.cluster,
                stage=rec.stage,
                first_layer=placed.first_layer,
                last_layer_exclusive=placed.last_layer_exclusive,
            )
        )
    return out


class PlacementMemory:
    """The placements one member's planning of an epoch keeps, stable while the epoch is planned.

    A member that activated epoch ``E``'s plan re-announces its new place, which ``E``'s planning leaves
    out (`previous_placements`); the place it had before still counts for ``E`` here. Without this, the
    members still proposing ``E`` lost the first activators' placements and proposed another plan (a lab
    kill's epoch ended split, 20 s lost). Newer information about a record still before ``E`` wins.
    """

    def __init__(self) -> None:
        self._for: tuple[int, str] | None = None  # the (epoch, workload) the memory is about
        self._seen: dict[str, PlacedStage] = {}

    def kept(
        self, records: Mapping[str, PeerRecord], live: Set[str], *, workload: str, epoch: int
    ) -> list[PlacedStage]:
        """`previous_placements` of the records, plus those seen earlier for this epoch whose peers
        have since moved on to it (still live), by peer id."""
        current = previous_placements(records, live, workload=workload, epoch=epoch)
        if self._for != (epoch, workload):
            self._for, self._seen = (epoch, workload), {}
        self._seen.update((p.peer_id, p) for p in current)
        moved_on = {pid for pid in live if pid in records and records[pid].epoch >= epoch}
        keep = {p.peer_id for p in current} | (moved_on & set(self._seen))
        return [self._seen[pid] for pid in sorted(keep)]
