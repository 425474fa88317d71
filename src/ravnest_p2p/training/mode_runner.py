"""Pick the runner of a job's role by the job's training mode (`training.modes`).

The supervisor owns a job's life whatever its mode; only the runner differs. ``pipeline`` runs a stage
(`training.runner.StageRunner`), ``sync_backup`` a worker that also owns parameter shards
(`training.sync_runner.SyncBackupRunner`), ``ist`` a worker that trains a sub-network per round and holds
the entries it trained (`training.ist_runner.IstRunner`). `UnsupportedModeRunner` stays for a mode a
peer cannot run: it fails at once with a reason the researcher sees in the metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ravnest_p2p.discovery import RunDHT
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.training.ist_runner import IstRunner
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.memory_fit import StageDoesNotFit
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.mode_placement import check_worker_fits
from ravnest_p2p.training.modes import TrainingMode
from ravnest_p2p.training.progress import ProgressStore
from ravnest_p2p.training.resume import HeldState
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.runner import StageRunner
from ravnest_p2p.training.stage_state import StageState
from ravnest_p2p.training.supervisor_seams import StageRun
from ravnest_p2p.training.sync_runner import SyncBackupRunner
from ravnest_p2p.transport.rpc import RpcEndpoint

__all__ = ["UnsupportedModeRunner", "start_mode_runner"]


class UnsupportedModeRunner:
    """A runner for a mode this package cannot run over the network yet: it fails with the reason."""

    def __init__(self, job: JobSpec, reason: str) -> None:
        self.job = job
        self.reason = reason
        self.stop_requested = asyncio.Event()
        self.held_state: HeldState | None = None

    async def run(self) -> None:
        raise RavnestError(f"job {self.job.job_id}: {self.reason}")


def start_mode_runner(
    rpc: RpcEndpoint,
    dht: RunDHT | ProgressStore | None,
    job: JobSpec,
    role: StageRole,
    state: StageState | None,
    *,
    on_exclude: Callable[[str, str], None] | None = None,
    on_metrics: Callable[[StageMetrics], None] | None = None,
    memory_available_bytes: int | None = None,
) -> StageRun:
    """The runner of `role` for the job's mode (the node's `RunnerFactory`).

    `memory_available_bytes` (the peer's cap minus its overhead; None: unchecked): a ``sync_backup`` or
    ``ist`` worker that does not fit it is refused before its model is built, with the reason as the
    run's failure (`training.mode_placement.check_worker_fits`); a pipeline stage checks its own.
    """
    if job.mode != TrainingMode.PIPELINE and memory_available_bytes is not None:
        try:
            check_worker_fits(job, memory_available_bytes)
        except StageDoesNotFit as exc:
            return UnsupportedModeRunner(job, str(exc))
    if job.mode == TrainingMode.SYNC_BACKUP:
        return SyncBackupRunner(rpc, dht, job, role, on_metrics=on_metrics)
    if job.mode == TrainingMode.IST:
        return IstRunner(rpc, dht, job, role, on_metrics=on_metrics)
    return StageRunner(rpc, dht, job, role, initial_state=state, on_exclude=on_exclude, on_metrics=on_metrics)
