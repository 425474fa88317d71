"""What a one-stage worker (sync_backup, IST) reports: held-out evaluation, metrics stored in the DHT, a
timing record (sync_backup, IST).

Split from `training.sync_runner` (the worker loop) so that each file stays one concern. The timing
record is logged once at the end of a worker's run (``sync timing {json}``): per-gradient compute
times and step times, the training loop's wall time, and its owned shards' staleness and drop
counters; an IST worker logs ``ist timing {json}`` (seconds and bytes of every round). The lab
benchmark (`benchmarks/bench_backup_lab.py`) reads it from the peers' logs; it is not a wire record.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ravnest_p2p.discovery import RunDHT
from ravnest_p2p.models import LossFn
from ravnest_p2p.training.data import ArrayDataset
from ravnest_p2p.training.metrics import METRICS_KEY, StageMetrics
from ravnest_p2p.training.progress import ProgressStore

if TYPE_CHECKING:
    from ravnest_p2p.training.ist_runner import IstRunner
    from ravnest_p2p.training.sync_runner import SyncBackupRunner

__all__ = ["evaluate", "ist_timing_record", "store_metrics", "timing_record"]

logger = logging.getLogger(__name__)

_MAX_TIMES = 4096


@torch.no_grad()
def evaluate(
    model: nn.Module, held_out: ArrayDataset, loss_fn: LossFn, batch_size: int
) -> tuple[float, float]:
    """(mean loss, accuracy) of `model` on `held_out` (accuracy 0 for non-classification losses)."""
    model.eval()
    total, correct, count = 0.0, 0, 0
    for start in range(0, len(held_out), batch_size):
        inputs = held_out.inputs[start : start + batch_size]
        labels = held_out.labels[start : start + batch_size]
        output = model(inputs)
        total += float(loss_fn(output, labels)) * labels.shape[0]
        if output.is_floating_point() and not labels.is_floating_point():
            correct += int((output.argmax(dim=-1) == labels).sum())
        count += int(labels.shape[0])
    return total / max(1, count), correct / max(1, count)


async def store_metrics(
    dht: RunDHT | ProgressStore, metrics: StageMetrics, *, final: bool, retry_for_s: float
) -> None:
    """Store `metrics` under the run's metrics key; a final record is retried for `retry_for_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (retry_for_s if final else 0.0)
    while True:
        try:
            stored = await dht.store_own(
                METRICS_KEY, metrics.model_dump(mode="json"), ttl_s=600, pin_to_initial_peers=final
            )
        except Exception as exc:
            stored = False
            logger.debug("metrics publication failed: %r", exc)
        if stored or loop.time() + 0.5 > deadline:
            return
        await asyncio.sleep(0.5)  # retry backoff, bounded by the deadline


def timing_record(runner: SyncBackupRunner) -> dict[str, Any]:
    """The worker's timing and its owned shards' counters (see module docstring)."""
    staleness: collections.Counter[int] = collections.Counter()
    dropped: collections.Counter[str] = collections.Counter()
    for owner in runner.owners.owned.values():
        staleness.update(owner.staleness)
        dropped.update(owner.dropped)
    return {
        "job_id": runner.job.job_id,
        "peer_id": runner.rpc.peer_id,
        "worker": runner.index,
        "steps": runner.step,
        "iterations": runner.iterations,
        "late": runner.late,
        "train_s": round(runner.train_s, 4),
        # the first ones only: one log line must stay small however long the job
        "gradient_times_s": [round(t, 4) for t in runner.gradient_times_s[:_MAX_TIMES]],
        "step_times_s": [round(t, 4) for t in runner.step_times_s[:_MAX_TIMES]],  # gradient + exchange
        "shards_owned": sorted(runner.owners.owned),
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "dropped": dict(dropped),
        "eval_accuracy": runner.eval_accuracy,
    }


def ist_timing_record(runner: IstRunner) -> dict[str, Any]:
    """An IST worker's rounds (seconds from pull to commit, of which pulling; bytes), its final gather."""
    return {
        "job_id": runner.job.job_id,
        "peer_id": runner.rpc.peer_id,
        "worker": runner.index,
        "rounds": runner.round,
        "local_steps": runner.config.local_steps,
        "round_s": [round(e["seconds"], 4) for e in runner.round_log[:_MAX_TIMES]],
        "round_pull_s": [round(e["pull_seconds"], 4) for e in runner.round_log[:_MAX_TIMES]],
        "round_bytes_pulled": [e["bytes_pulled"] for e in runner.round_log[:_MAX_TIMES]],
        "final_pull_s": round(runner.final_pull_s, 4),
        "compute_s": round(runner.compute_s, 4),
        "eval_accuracy": runner.eval_accuracy,
    }
