"""Lay a ``sync_backup`` or ``ist`` job out over live peers: its explicit assignment from measured records.

The bridge from `PeerRecord`s and a `JobSpec` to the pure rule `planning.mode_layout` (which peers are
workers, which own shards) and back to the job's assignment: one single-stage cluster per worker, in
the layout's order (fastest first), and for ``sync_backup`` with backups the N fastest as `owners`.

What one worker needs (the pipeline planner's memory model, `planning.memory`, for a window of one: a
worker runs one batch at a time):
- ``sync_backup``: the whole model trained by one peer: parameters, one copy of the trainable weights
  (the step's parameters kept for the exchange or for local SGD), gradients, optimizer state and one
  batch's activations, times the planner's headroom. Per step it computes one batch and exchanges
  about one gradient and one set of parameters.
- ``ist``: the worker's replica of the whole model (parameters and buffers) plus the sub-network it
  trains (round 0's deal, worker 0: every part has the same size to a unit), budgeted like a stage.
  Per round it computes `ist.local_steps` batches of the sub-network and receives and serves about one
  sub-network.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ravnest_p2p.discovery.records import PeerRecord
from ravnest_p2p.models import build_model, count_layers, profile_layers, sample_input
from ravnest_p2p.planning import JobParams
from ravnest_p2p.planning.memory import layer_memory_bytes
from ravnest_p2p.planning.mode_layout import ModeLayout, ist_layout, sync_backup_layout
from ravnest_p2p.strategies.ist import ScaleRule, deal_hidden_units, extract_subnetwork, hidden_sizes
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.memory_fit import StageDoesNotFit
from ravnest_p2p.training.modes import TrainingMode
from ravnest_p2p.training.placement import (
    capacities_from_records,
    job_serving,
    layer_profiles,
    optimizer_slots_name,
)
from ravnest_p2p.types import LayerProfile

__all__ = ["WorkerNeed", "check_worker_fits", "mode_layout", "place_mode_job", "worker_need"]

WorkerNeed = tuple[
    int, float, float
]  # (memory bytes with headroom, FLOPs per step, bytes exchanged per step)


def _trainable_bytes(layers: Sequence[LayerProfile]) -> int:
    return sum(
        layer.param_bytes if layer.trainable_bytes is None else layer.trainable_bytes for layer in layers
    )


def _ist_subnetwork_profiles(job: JobSpec) -> tuple[list[LayerProfile], int]:
    """(profiles of worker 0's round-0 sub-network, bytes of the whole replica)."""
    layers = build_model(job.model, job.model_params, seed=job.seed)
    replica_bytes = sum(t.numel() * t.element_size() for t in nn.Sequential(*layers).state_dict().values())
    deal = deal_hidden_units(hidden_sizes(layers), job.ist.num_workers, round_index=0, seed=job.seed)
    sub = extract_subnetwork(layers, deal, 0, scale_rule=ScaleRule(job.ist.scale_rule))
    x = sample_input(job.model, job.model_params)
    return profile_layers(sub, x, optimizer=optimizer_slots_name(job)), replica_bytes


def worker_need(job: JobSpec) -> WorkerNeed:
    """What one worker of the job's mode needs: memory (headroom in), FLOPs and bytes per step.

    Raises:
        ValueError: the job's mode is ``pipeline``, or (``ist``) the model is not shaped like `wide_mlp`.
    """
    params = JobParams(micro_batch_size=job.batch_size, max_in_flight=1)
    if job.mode == TrainingMode.SYNC_BACKUP:
        layers = layer_profiles(job)
        need = sum(layer_memory_bytes(layer, params) for layer in layers)
        flops = job.batch_size * job.sync_backup.local_steps * sum(layer.flops_per_sample for layer in layers)
        return need, flops, 2.0 * _trainable_bytes(layers)
    if job.mode == TrainingMode.IST:
        sub, replica_bytes = _ist_subnetwork_profiles(job)
        need = replica_bytes + sum(layer_memory_bytes(layer, params) for layer in sub)
        flops = job.batch_size * job.ist.local_steps * sum(layer.flops_per_sample for layer in sub)
        return need, flops, 2.0 * _trainable_bytes(sub)
    raise ValueError(f"job {job.job_id}: mode {job.mode.value} has no worker layout (it plans clusters)")


def check_worker_fits(job: JobSpec, available_bytes: int) -> int:
    """Raise `StageDoesNotFit` unless one worker of the job's mode fits `available_bytes`; return the need.

    A peer's own guard before it builds a worker (the client's layout already used the same figure, so
    it fails only on a hand-written assignment or when the peer's memory changed).
    """
    need, _, _ = worker_need(job)
    if need > available_bytes:
        raise StageDoesNotFit(
            f"a {job.mode.value} worker of job {job.job_id} needs {need / 2**30:.2f} GiB (x1.1 headroom in) "
            f"but this peer has {available_bytes / 2**30:.2f} GiB under its cap"
        )
    return need


def mode_layout(records: Sequence[PeerRecord], job: JobSpec) -> ModeLayout:
    """The workers (and owners) of the job over the live `records` (`planning.mode_layout`).

    Raises:
        planning.mode_layout.WorkerDoesNotFit: no peer can hold one worker.
        planning.InfeasiblePlan: too few peers can.
    """
    need, flops, exchange = worker_need(job)
    peers = capacities_from_records(records, serving=job_serving(job))
    if job.mode == TrainingMode.SYNC_BACKUP:
        config = job.sync_backup
        return sync_backup_layout(
            peers,
            num_required=config.num_required,
            num_backup=config.num_backup,
            need_bytes=need,
            compute_flops=flops,
            exchange_bytes=exchange,
        )
    return ist_layout(
        peers, num_workers=job.ist.num_workers, need_bytes=need, compute_flops=flops, exchange_bytes=exchange
    )


def place_mode_job(records: Sequence[PeerRecord], job: JobSpec) -> JobSpec:
    """`job` with the assignment (and ``sync_backup`` owners, unless the job names them) of its layout."""
    layout = mode_layout(records, job)
    num_layers = count_layers(job.model, job.model_params)
    assignment = tuple(
        (StagePlacement(peer_id=w, first_layer=0, end_layer=num_layers),) for w in layout.workers
    )
    update: dict[str, object] = {"assignment": assignment}
    if job.mode == TrainingMode.SYNC_BACKUP and job.sync_backup.owners is None and layout.owners is not None:
        update["sync_backup"] = job.sync_backup.model_copy(update={"owners": layout.owners})
    # validated again: the assignment must agree with the mode's worker count and the owners with it
    return JobSpec.model_validate({**job.model_dump(), **update})
