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
from ravnest_p2p.training.metrics import StageMetrics
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
) -> StageRun:
    """The runner of `role` for the job's mode (the node's `RunnerFactory`)."""
    if job.mode == TrainingMode.SYNC_BACKUP:
        return SyncBackupRunner(rpc, dht, job, role, on_metrics=on_metrics)
    if job.mode == TrainingMode.IST:
        return IstRunner(rpc, dht, job, role, on_metrics=on_metrics)
    return StageRunner(rpc, dht, job, role, initial_state=state, on_exclude=on_exclude, on_metrics=on_metrics)
