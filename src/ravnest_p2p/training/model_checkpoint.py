"""A whole model's checkpoint, assembled from the stage owners of a job, and its use in one process.

`assemble_checkpoint` asks each stage owner of one cluster (the first whose every stage answers) for
all it holds of the job (`handover.fetch_state` over layers [0, N)), checks every parameter and buffer
against the digests the owner published in its final `StageMetrics` and every name, dtype and shape
against the model the registry builds, and writes one ``kind="model"`` checkpoint: a safetensors file
keyed by global names (``<layer>.<attr>``, plus ``optim/...`` optimizer state) and a JSON manifest with
the JobSpec and the job's progress. The global names of parameters and buffers are exactly the
``state_dict`` keys of ``nn.Sequential(*build_model(...))``, so `load_model` is a plain strict
``load_state_dict``; `evaluate_model` scores it like the pipeline's own evaluation does.

Limits: it reads a finished job (owners publish digests when done; a stage still training fails the
fetch with `StateChanged`); the client holds the whole model once in memory while it writes it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ravnest_p2p.errors import RavnestError
from ravnest_p2p.models import build_model
from ravnest_p2p.models.registry import get_model_spec, parse_config
from ravnest_p2p.models.spec import make_loss
from ravnest_p2p.training.checkpoint import CheckpointManifest, load_checkpoint, write_checkpoint_file
from ravnest_p2p.training.data import ArrayDataset
from ravnest_p2p.training.handover import HandoverError, fetch_state
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.stage_state import StageState, expected_entries, is_model_entry, merge_states
from ravnest_p2p.training.stages import build_stage, load_dataset
from ravnest_p2p.transport.rpc import RpcEndpoint

__all__ = ["assemble_checkpoint", "evaluate_model", "load_model"]

logger = logging.getLogger(__name__)


def _clusters(metrics: Sequence[StageMetrics], job_id: str) -> list[list[StageMetrics]]:
    """Complete clusters (every stage index present once) of the newest epoch, lowest index first."""
    mine = [m for m in metrics if m.job_id == job_id]
    if not mine:
        return []
    epoch = max(m.epoch for m in mine)
    by_cluster: dict[int, dict[int, StageMetrics]] = {}
    for m in mine:
        if m.epoch == epoch:
            by_cluster.setdefault(m.cluster, {})[m.stage] = m
    out = []
    for cluster in sorted(by_cluster):
        stages = by_cluster[cluster]
        num = max(m.num_stages for m in stages.values())
        if sorted(stages) == list(range(num)):
            out.append([stages[i] for i in range(num)])
    return out


async def assemble_checkpoint(
    rpc: RpcEndpoint,
    job: JobSpec,
    metrics: Sequence[StageMetrics],
    path: Path,
    *,
    require_digests: bool = True,
    timeout_s: float = 300.0,
) -> CheckpointManifest:
    """Fetch the job's state from its stage owners and write it as one model checkpoint at `path`.

    Args:
        rpc: an endpoint of the run (namespace = run id); its peer must be a member or a state reader.
        job: the job (its model is built here to know every name, dtype and shape to expect).
        metrics: the job's stage metrics (e.g. `RunClient.metrics(job_id=...)`): who owns which stage,
            and the digests they published when done.
        path: where the ``.safetensors`` goes (the manifest goes next to it, ``.json``).
        require_digests: refuse stages that published no digests (not done).

    Raises:
        RavnestError: no cluster could deliver a complete, verified state.
    """
    reference = build_stage(job, 0, len(build_model(job.model, job.model_params)), max_in_flight=1)
    expected = expected_entries(reference)
    model_names = {n for n in expected if is_model_entry(n)}  # not optimizer or outer state
    num_layers = len(reference.module)
    clusters = _clusters(metrics, job.job_id)
    if not clusters:
        raise RavnestError(f"no complete cluster of job {job.job_id} in the metrics")
    problems: list[str] = []
    for stages in clusters:
        parts: list[StageState] = []
        try:
            for m in stages:
                if require_digests and not m.param_digests:
                    raise HandoverError(f"stage {m.stage} ({m.peer_id}) published no digests (not done?)")
                parts.append(
                    await fetch_state(
                        rpc,
                        m.peer_id,
                        job.job_id,
                        layers=(0, num_layers),
                        epoch=m.epoch,
                        expected=expected,
                        expected_digests=m.param_digests,
                        timeout_s=timeout_s,
                    )
                )
                published = set(m.param_digests or {})
                if not published <= set(parts[-1].tensors):
                    raise HandoverError(f"stage {m.stage} did not send all it published digests of")
            state = merge_states(parts, meta=parts[0].meta)
        except (HandoverError, ValueError) as exc:
            problems.append(f"cluster {stages[0].cluster}: {exc}")
            logger.info("checkpoint from cluster %d failed: %s", stages[0].cluster, exc)
            continue
        missing = model_names - set(state.tensors)
        if missing:
            problems.append(f"cluster {stages[0].cluster}: no state for {sorted(missing)[:3]}")
            continue
        first = stages[0]
        progress: dict[str, int | float | str] = {
            "epoch": first.epoch,
            "cluster": first.cluster,
            "micro_batches": first.step,
            "optimizer_steps": first.optimizer_steps,
        }
        if first.eval_accuracy is not None:
            progress["eval_accuracy"] = first.eval_accuracy
        if first.eval_loss is not None:
            progress["eval_loss"] = first.eval_loss
        manifest_path = write_checkpoint_file(
            Path(path),
            state.tensors,
            job=job,
            step=first.optimizer_steps,
            first_layer=0,
            end_layer=num_layers,
            meta=state.meta,
            progress=progress,
            kind="model",
            digests=state.digests,
        )
        manifest, _ = load_checkpoint(manifest_path, job=job)  # read back what we wrote
        return manifest
    raise RavnestError(f"no verified checkpoint of job {job.job_id}: {'; '.join(problems)}")


def load_model(
    path: Path, *, manifest_digest: str | None = None
) -> tuple[JobSpec, nn.Sequential, CheckpointManifest]:
    """Load a model checkpoint (verified) into a single-process ``nn.Sequential`` in eval mode.

    Raises:
        CheckpointError: the files do not verify; ValueError: not a model checkpoint of a known model.
    """
    manifest, state = load_checkpoint(Path(path), manifest_digest=manifest_digest)
    if manifest.kind != "model" or manifest.job is None:
        raise ValueError(f"{path} is a {manifest.kind} checkpoint, not a model's")
    job = JobSpec.model_validate(manifest.job)
    module = nn.Sequential(*build_model(job.model, job.model_params, seed=job.seed))
    module.load_state_dict({n: t for n, t in state.tensors.items() if is_model_entry(n)}, strict=True)
    return job, module.eval(), manifest


def evaluate_model(
    job: JobSpec, module: nn.Module, dataset: ArrayDataset | None = None
) -> tuple[float, float]:
    """(mean loss, accuracy) of `module` on `dataset` (default: the job's held-out split), as the pipeline
    evaluates: per-sample mean loss, and argmax accuracy over label elements for classification."""
    held_out = dataset if dataset is not None else load_dataset(job)[1]
    loss_fn = make_loss(get_model_spec(job.model).loss(parse_config(job.model, job.model_params)))
    loss_sum, correct, samples, targets = 0.0, 0, 0, 0
    module.eval()
    with torch.no_grad():
        for i in range(0, len(held_out), job.eval_batch_size):
            x = held_out.inputs[i : i + job.eval_batch_size]
            y = held_out.labels[i : i + job.eval_batch_size]
            out = module(x)
            loss_sum += max(float(loss_fn(out, y)) * y.shape[0], 0.0)
            if out.is_floating_point() and not y.is_floating_point():
                correct += int((out.argmax(dim=-1) == y).sum())
            samples += int(y.shape[0])
            targets += int(y.numel())
    return loss_sum / max(samples, 1), correct / max(targets, 1)
