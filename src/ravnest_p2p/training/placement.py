"""Bridge from what peers publish and what the researcher asks for to the pure planner, and back.

`plan_assignment` turns live `PeerRecord`s and a `JobSpec` into the job's explicit `assignment` via
`planning.make_plan`: the layer profile comes from a dry run of the job's model, peer capacities from
the measured figures in the records, and the link matrix from the links each record reports
(`links_from_records`) — the same measured pairs the peers' own agreed plans use, so a researcher's
explicit plan sees the same slow links (unmeasured pairs fall back to min(up, down), as there).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from ravnest_p2p.discovery.records import PeerRecord, Serving
from ravnest_p2p.models import (
    build_layers,
    build_model,
    count_layers,
    get_model_spec,
    inter_layer_spec,
    profile_layers,
    sample_input,
)
from ravnest_p2p.models.registry import BUILTIN_MODELS
from ravnest_p2p.planning import (
    InfeasiblePlan,
    JobParams,
    LinkMatrix,
    LinkReport,
    PeerCapacity,
    Plan,
    make_plan,
)
from ravnest_p2p.planning.memory import memory_shortfall
from ravnest_p2p.planning.window import planning_window
from ravnest_p2p.training.datasets import BUILTIN_DATASETS
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.types import LayerProfile, PeerState

__all__ = [
    "assignment_from_plan",
    "capacities_from_records",
    "job_params",
    "job_serving",
    "layer_profiles",
    "links_from_records",
    "optimizer_slots_name",
    "plan_assignment",
    "stage_profiles",
]

# A peer that has not measured its link yet is planned as if on a modest home connection.
_DEFAULT_LINK_MBPS = 10.0


def _stage_input(job: JobSpec, first_layer: int, batch_size: int) -> Tensor:
    if first_layer == 0:
        return sample_input(job.model, job.model_params, batch_size=batch_size)
    spec = inter_layer_spec(job.model, job.model_params, first_layer - 1)
    generator = torch.Generator().manual_seed(0)
    if spec.dtype.is_floating_point:
        return torch.randn((batch_size, *spec.shape), generator=generator, dtype=spec.dtype)
    return torch.randint(0, spec.high or 2, (batch_size, *spec.shape), generator=generator, dtype=spec.dtype)


def _one_at_a_time(job: JobSpec, first_layer: int, end_layer: int) -> Iterator[nn.Module]:
    for index in range(first_layer, end_layer):
        yield build_layers(job.model, job.model_params, seed=job.seed, start=index, end=index + 1)[0]


def stage_profiles(job: JobSpec, first_layer: int, end_layer: int) -> list[LayerProfile]:
    """Profiles of layers [first_layer, end_layer) of the job's model.

    Models that build by range (`ModelSpec.build_range`) build only those layers, one at a time, fed a
    random input of the stage's input spec: a 1B model is profiled in the memory of its largest layer.
    Others are built whole and profiled from their first layer.
    """
    optimizer = optimizer_slots_name(job)
    if get_model_spec(job.model).build_range is None:
        layers = build_model(job.model, job.model_params, seed=job.seed)
        return profile_layers(layers, sample_input(job.model, job.model_params), optimizer=optimizer)[
            first_layer:end_layer
        ]
    x = _stage_input(job, first_layer, batch_size=2)
    return profile_layers(_one_at_a_time(job, first_layer, end_layer), x, optimizer=optimizer)


def layer_profiles(job: JobSpec) -> list[LayerProfile]:
    """Profiles of every layer of the job's model (see `stage_profiles`)."""
    return stage_profiles(job, 0, count_layers(job.model, job.model_params))


def optimizer_slots_name(job: JobSpec) -> str:
    """The `models.profile.OPTIMIZER_STATE_SLOTS` key of the job's optimizer."""
    return "sgd_momentum" if job.optimizer.name == "sgd" and job.optimizer.momentum else job.optimizer.name


def capacities_from_records(
    records: Sequence[PeerRecord], *, serving: Serving | None = None
) -> list[PeerCapacity]:
    """Peers that can train (ready or training, reachable, measured compute, serving the job's plugins
    if `serving` is given) as planner inputs."""
    out = []
    for r in records:
        if r.state not in (PeerState.READY, PeerState.TRAINING) or r.client_mode or r.flops <= 0:
            continue
        if serving is not None and not serving.met_by(r):
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


def job_serving(job: JobSpec) -> Serving:
    """What `job` needs of a peer: the plugin model/data set it names (built-ins every peer has)."""
    return Serving(
        job_id=job.job_id,
        plugin_models=frozenset({job.model} - BUILTIN_MODELS),
        plugin_datasets=frozenset({job.dataset} - BUILTIN_DATASETS.keys()),
    )


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
        num_layers = count_layers(job.model, job.model_params)
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
    """Clusters and stages for `job` over the live `records`.

    Args:
        use_links: plan with the measured link matrix (`links_from_records`); False: each peer's own
            up/down figures only.

    Raises:
        InfeasiblePlan: no cluster fits; the message says how much memory the model needs and what the
            peers offer (`planning.memory.memory_shortfall`).
    """
    layers = layer_profiles(job)
    peers = capacities_from_records(records, serving=job_serving(job))
    params = job_params(job, min_stages=min_stages, num_layers=len(layers))
    plan = make_plan(
        peers,
        layers,
        params,
        epoch=epoch,
        links=links_from_records(records, peers) if use_links else None,
    )
    if not plan.clusters:
        why = memory_shortfall(peers, layers, params) or "no cluster of these peers can hold it"
        raise InfeasiblePlan(f"cannot plan job {job.job_id!r} ({job.model}): {why}")
    return assignment_from_plan(plan)
