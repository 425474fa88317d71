"""Turn a JobSpec and a stage placement into a ready `StageExecutor`, and the job's data into batches.

Every peer builds its layers from (key, config, seed), so all replicas and all stages start from
bit-identical weights without shipping any. Models that can (`ModelSpec.build_range`, e.g. `causal_lm`)
build only the stage's own layers; the others are built whole and sliced.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from torch import Tensor

from ravnest_p2p.models import build_layers, count_layers, get_model_spec, inter_layer_spec, parse_config
from ravnest_p2p.models.spec import TensorSpec
from ravnest_p2p.runtime.config import StageConfig
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.data import ArrayDataset, iterate_batches, num_batches
from ravnest_p2p.training.datasets import load_job_data
from ravnest_p2p.training.job import JobSpec

__all__ = [
    "as_model_input",
    "build_stage",
    "label_spec",
    "load_dataset",
    "num_layers",
    "steps_per_cluster",
    "train_batches",
]


def num_layers(job: JobSpec) -> int:
    return count_layers(job.model, job.model_params)


def label_spec(job: JobSpec) -> TensorSpec:
    """What the job's labels look like (dtype, shape, classes): every stage checks the labels it relays."""
    return get_model_spec(job.model).label_spec(parse_config(job.model, job.model_params))


def build_stage(job: JobSpec, first_layer: int, end_layer: int, *, max_in_flight: int) -> StageExecutor:
    """The executor for layers [first_layer, end_layer) of the job's model."""
    total = num_layers(job)
    if not 0 <= first_layer < end_layer <= total:
        raise ValueError(f"stage [{first_layer}, {end_layer}) outside a model of {total} layers")
    layers = build_layers(job.model, job.model_params, seed=job.seed, start=first_layer, end=end_layer)
    spec = get_model_spec(job.model)
    config = parse_config(job.model, job.model_params)
    if first_layer == 0:
        input_spec = spec.input_spec(config)
    else:
        input_spec = inter_layer_spec(job.model, job.model_params, first_layer - 1)
    is_last = end_layer == total
    stage_config = StageConfig(
        first_layer_index=first_layer,
        is_last=is_last,
        max_in_flight=max_in_flight,
        update_every=job.update_every,
        recompute=job.recompute,
        loss=spec.loss(config),
        optimizer=job.optimizer,
    )
    return StageExecutor(
        stage_config,
        layers,
        input_spec=input_spec,
        label_spec=spec.label_spec(config) if is_last else None,
    )


def load_dataset(job: JobSpec) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, held-out) splits of the job's data set (`training.datasets`: checked against its digest),
    their inputs in the model's input shape (`as_model_input`)."""
    train, held_out = load_job_data(job)
    return as_model_input(job, train), as_model_input(job, held_out)


def as_model_input(job: JobSpec, data: ArrayDataset) -> ArrayDataset:
    """`data` with its inputs reshaped to the model's input shape when a sample holds exactly as many
    elements in another shape (the digits' ``(1, 8, 8)`` images for the 64 inputs of `mlp` or `wide_mlp`).

    A whole model flattens such inputs itself, but a pipeline's first stage checks what it is fed against
    the model's input spec, and refused every digits micro-batch of an MLP. Anything else is left as it is
    (and refused there, if it does not fit).
    """
    shape = tuple(get_model_spec(job.model).input_spec(parse_config(job.model, job.model_params)).shape)
    sample = tuple(data.inputs.shape[1:])
    if sample == shape or math.prod(sample) != math.prod(shape):
        return data
    return ArrayDataset(data.inputs.reshape(data.inputs.shape[0], *shape), data.labels)


def steps_per_cluster(job: JobSpec, num_samples: int, num_clusters: int) -> int:
    """Micro-batches every cluster trains: the same for all, so replicas pair averaging rounds by step."""
    per_epoch = num_batches(num_samples, batch_size=job.batch_size, num_shards=num_clusters)
    total = per_epoch * job.num_epochs
    return min(total, job.max_steps) if job.max_steps is not None else total


def train_batches(
    job: JobSpec, dataset: ArrayDataset, *, cluster_index: int, num_clusters: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """The cluster's micro-batches over all epochs (its own shard and shuffle).

    Every cluster yields exactly `steps_per_cluster` batches (shards differ by a sample at most; the
    surplus batch of a larger shard is skipped), capped at `max_steps`.
    """
    per_epoch = num_batches(len(dataset), batch_size=job.batch_size, num_shards=num_clusters)
    steps = 0
    for epoch in range(job.num_epochs):
        for index, batch in enumerate(
            iterate_batches(
                dataset,
                batch_size=job.batch_size,
                seed=job.seed,
                epoch=epoch,
                shard_index=cluster_index,
                num_shards=num_clusters,
            )
        ):
            if index >= per_epoch:
                break
            if job.max_steps is not None and steps >= job.max_steps:
                return
            steps += 1
            yield batch
