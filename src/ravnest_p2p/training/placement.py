"""Bridge from what peers publish and what the researcher asks for to the pure planner, and back.

`plan_assignment` turns live `PeerRecord`s and a `JobSpec` into the job's explicit `assignment` via
`planning.make_plan`: the layer profile comes from a dry run of the job's model, peer capacities from
the measured figures in the records, and the link matrix from the links each record reports
(`links_from_records`) — the same measured pairs the peers' own agreed plans use, so a researcher's
explicit plan sees the same slow links (unmeasured pairs fall back to min(up, down), as there).
"""

from __future__ import annotations

from collections.abc import Sequence

from ravnest_p2p.discovery.records import PeerRecord
from ravnest_p2p.models import build_model, profile_layers, sample_input
from ravnest_p2p.planning import JobParams, LinkMatrix, LinkReport, PeerCapacity, Plan, make_plan
from ravnest_p2p.planning.window import planning_window
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.types import LayerProfile, PeerState

__all__ = [
    "assignment_from_plan",
    "capacities_from_records",
    "job_params",
    "layer_profiles",
    "links_from_records",
    "plan_assignment",
]

# A peer that has not measured its link yet is planned as if on a modest home connection.
_DEFAULT_LINK_MBPS = 10.0


def layer_profiles(job: JobSpec) -> list[LayerProfile]:
    layers = build_model(job.model, job.model_params, seed=job.seed)
    optimizer = (
        "sgd_momentum" if job.optimizer.name == "sgd" and job.optimizer.momentum else job.optimizer.name
    )
    return profile_layers(layers, sample_input(job.model, job.model_params), optimizer=optimizer)


def capacities_from_records(records: Sequence[PeerRecord]) -> list[PeerCapacity]:
    """Peers that can train (ready or training, reachable, measured compute) as planner inputs."""
    out = []
    for r in records:
        if r.state not in (PeerState.READY, PeerState.TRAINING) or r.client_mode or r.flops <= 0:
            continue
        up = r.upload_mbps or _DEFAULT_LINK_MBPS
        down = r.download_mbps or _DEFAULT_LINK_MBPS
        out.append(
            PeerCapacity(
                peer_id=r.peer_id,
                flops_per_s=r.flops,
                memory_bytes=r.free_memory_bytes,
                upload_bytes_per_s=up * 1e6 / 8,
                download_bytes_per_s=down * 1e6 / 8,
            )
        )
    return out


def links_from_records(records: Sequence[PeerRecord], peers: Sequence[PeerCapacity]) -> LinkMatrix:
    """The link matrix of `peers` from the links their records report (others' reports are ignored)."""
    reports = {
        r.peer_id: [
            LinkReport(
                peer_id=link.peer_id,
                upload_bytes_per_s=link.up_mbps * 1e6 / 8,
                download_bytes_per_s=link.down_mbps * 1e6 / 8,
                rtt_s=link.rtt_ms / 1000,
            )
            for link in r.links
        ]
        for r in records
    }
    return LinkMatrix.build(peers, reports)


def job_params(job: JobSpec, *, min_stages: int | None = None, num_layers: int | None = None) -> JobParams:
    """The planner's view of `job`; memory is budgeted for `planning_window` (see `planning.window`).

    Args:
        job: the job.
        min_stages: overrides the job's `min_stages`.
        num_layers: the model's layer count (the most stages a cluster can have); built if None.
    """
    if num_layers is None:
        num_layers = len(build_model(job.model, job.model_params))
    return JobParams(
        micro_batch_size=job.batch_size,
        max_in_flight=planning_window(job.max_in_flight, num_layers),
        min_stages=min_stages if min_stages is not None else job.min_stages,
    )


def assignment_from_plan(plan: Plan) -> tuple[tuple[StagePlacement, ...], ...]:
    return tuple(
        tuple(
            StagePlacement(peer_id=s.peer_id, first_layer=s.first_layer, end_layer=s.last_layer_exclusive)
            for s in cluster.stages
        )
        for cluster in plan.clusters
    )


def plan_assignment(
    records: Sequence[PeerRecord],
    job: JobSpec,
    *,
    epoch: int = 0,
    min_stages: int | None = None,
    use_links: bool = True,
) -> tuple[tuple[StagePlacement, ...], ...]:
    """Clusters and stages for `job` over the live `records` (raises `InfeasiblePlan` if none fit).

    Args:
        use_links: plan with the measured link matrix (`links_from_records`); False: each peer's own
            up/down figures only.
    """
    layers = layer_profiles(job)
    peers = capacities_from_records(records)
    plan = make_plan(
        peers,
        layers,
        job_params(job, min_stages=min_stages, num_layers=len(layers)),
        epoch=epoch,
        links=links_from_records(records, peers) if use_links else None,
    )
    return assignment_from_plan(plan)
