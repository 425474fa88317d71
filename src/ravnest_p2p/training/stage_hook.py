"""What a running stage does for the state that outlives its plan: serve it, checkpoint it, announce it.

`attach_stage_state` is the one call `StageRunner.run` makes once its stage is built: it publishes the
live stage on this peer's `HandoverServer` (for the next plan's owners and the job's state readers;
the stage stays published after the run ends, so its final state can be fetched), and, when the job
asks for checkpoints and this peer keeps them, writes a checkpoint after the optimizer steps that are
due and announces it under the run's ``checkpoints`` key.

Where checkpoints go is the peer's choice, not the job's: ``runner.checkpoint_dir`` if the composition
root set one, else the ``RAVNEST_CHECKPOINT_DIR`` environment variable, else nowhere.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ravnest_p2p.runtime.service import StageService
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.checkpoint import (
    CheckpointConfig,
    CheckpointFileSource,
    CheckpointWriter,
    write_checkpoint_file,
)
from ravnest_p2p.training.checkpoint_fetch import announce_disk
from ravnest_p2p.training.handover import (
    ExecutorSource,
    HandoverError,
    HandoverServer,
    StateSource,
    StaticSource,
    fetch_state,
    list_state,
)
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stage_state import (
    OPTIM_PREFIX,
    OUTER_PREFIX,
    StageState,
    capture_meta,
    capture_state,
    entries_digest,
    expected_entries,
    live_tensors,
    names_in_layers,
    restore_state,
)
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import TaskOwner, run_in_compute_thread

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "StageStateHook",
    "attach_stage_state",
    "checkpoint_config_for",
    "init_from_checkpoint",
    "snapshot_on_disk",
]

logger = logging.getLogger(__name__)

CHECKPOINT_DIR_ENV = "RAVNEST_CHECKPOINT_DIR"

Progress = Callable[[], Mapping[str, int | float | str]]


def checkpoint_config_for(job: JobSpec, directory: Path | str | None) -> CheckpointConfig | None:
    """The job's checkpoint schedule in `directory` (or the environment's), or None if either is unset."""
    directory = directory or os.environ.get(CHECKPOINT_DIR_ENV) or None
    if directory is None or not (job.checkpoint_every_steps or job.checkpoint_every_s):
        return None
    return CheckpointConfig(
        every_steps=job.checkpoint_every_steps,
        every_s=job.checkpoint_every_s,
        keep_last=job.checkpoint_keep_last,
        dir=Path(directory),
    )


class StageStateHook:
    """Serves one stage's live state and writes its checkpoints (see the module docstring)."""

    def __init__(
        self,
        rpc: RpcEndpoint,
        dht: Any,
        job: JobSpec,
        executor: StageExecutor,
        *,
        epoch: int,
        allowed: Iterable[str],
        tasks: TaskOwner,
        checkpoint: CheckpointConfig | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.rpc = rpc
        self.dht = dht
        self.job = job
        self.executor = executor
        self.epoch = epoch
        self.allowed = frozenset(allowed)
        self._tasks = tasks
        self._progress = progress
        first = executor.config.first_layer_index
        self.writer = (
            CheckpointWriter(checkpoint, job, first_layer=first, end_layer=first + len(executor.module))
            if checkpoint is not None
            else None
        )
        self.saved_steps: list[int] = []

    async def start(self) -> None:
        server = HandoverServer.of(self.rpc)
        await server.start()
        server.publish(
            self.job.job_id,
            ExecutorSource(self.executor, self._progress),
            epoch=self.epoch,
            allowed=self.allowed,
        )
        if self.writer is not None:  # its checkpoints too, for owners after a restart (checkpoint_fetch)
            server.serve_checkpoints(self.job.job_id, self.writer.config.dir, allowed=self.allowed)

    async def rebase(self, epoch: int, allowed: Iterable[str]) -> None:
        """The stage keeps running on plan `epoch` (`training.continuity`): serve it live there to
        `allowed`, and serve the old epoch as a snapshot taken now to the old and new members: the
        re-formed clusters' new owners fetch it as the old plan's state, and a live stage that keeps
        training would change under their transfer (`handover.StateChanged`). The snapshot goes to disk
        (`snapshot_on_disk`), not to a second copy of the stage in memory."""
        server = HandoverServer.of(self.rpc)
        progress = dict(self._progress()) if self._progress else None
        old_epoch, members = self.epoch, self.allowed | frozenset(allowed)
        try:
            snapshot: StateSource = await run_in_compute_thread(
                snapshot_on_disk, self.executor, self.job, epoch=old_epoch, progress=progress
            )
        except OSError as exc:  # e.g. a full disk: a copy in memory, as before
            logger.warning("snapshot of epoch %d not written (%r): keeping a copy in memory", old_epoch, exc)
            state = await run_in_compute_thread(capture_state, self.executor, progress=progress)
            snapshot = StaticSource(state, f"epoch-{old_epoch}")
        server.publish(self.job.job_id, snapshot, epoch=old_epoch, allowed=members)
        self.epoch, self.allowed = epoch, frozenset(allowed)
        server.publish(
            self.job.job_id, ExecutorSource(self.executor, self._progress), epoch=epoch, allowed=self.allowed
        )
        if self.writer is not None:
            server.serve_checkpoints(self.job.job_id, self.writer.config.dir, allowed=members)

    async def on_step(self, step: int) -> None:
        """After an optimizer step (the stage's work waits): write a checkpoint if one is due."""
        writer = self.writer
        if writer is None or not writer.due(step):
            return
        progress = dict(self._progress()) if self._progress else {}
        try:
            await run_in_compute_thread(self._save, writer, step, progress)
        except Exception as exc:  # a full disk must not fail the stage
            logger.warning("checkpoint of step %d not written: %r", step, exc)
            return
        self.saved_steps.append(step)
        if self.dht is not None:
            self._tasks.spawn(self._announce(writer), name=f"announce-checkpoint-{step}")

    def _save(self, writer: CheckpointWriter, step: int, progress: Mapping[str, int | float | str]) -> None:
        meta = capture_meta(self.executor, progress)
        writer.save(live_tensors(self.executor), step=step, meta=meta, progress=progress)

    async def _announce(self, writer: CheckpointWriter) -> None:
        # every layer range this peer's disk holds, not only this stage's: the announcement replaces the
        # peer's previous one, and the ranges it held on earlier plans must stay findable (a full restart
        # that lost them resumed one stage from an older step than the next)
        try:
            await announce_disk(self.dht, writer.config.dir, self.job, self.rpc.peer_id)
        except Exception as exc:
            logger.info("checkpoint announcement failed: %r", exc)


async def init_from_checkpoint(
    rpc: RpcEndpoint, job: JobSpec, executor: StageExecutor, *, timeout_s: float = 300.0
) -> int:
    """Load the stage's layers of `job.init_checkpoint` from the peer serving it; returns tensors loaded.

    The server's listing of the whole checkpoint must hash to the job's ``state_digest`` (so its
    per-tensor digests can be trusted), then the stage's names are fetched against those digests and
    against the stage's own schema, and restored all or nothing.

    Raises:
        HandoverError: the checkpoint cannot be fetched or does not verify (the stage is unchanged).
    """
    init = job.init_checkpoint
    assert init is not None
    listing = await list_state(rpc, init.peer_id, init.source_id, layers=(0, 1 << 30), timeout_s=timeout_s)
    if entries_digest(listing.entries) != init.state_digest:
        raise HandoverError(f"the checkpoint {init.peer_id} serves is not the one job {job.job_id} names")
    first = executor.config.first_layer_index
    digests = {e.name: e.digest for e in listing.entries}
    names = names_in_layers(digests, first, first + len(executor.module))
    if init.mode == "weights":
        names = [n for n in names if not n.startswith((OPTIM_PREFIX, OUTER_PREFIX))]
    state = await fetch_state(
        rpc,
        init.peer_id,
        init.source_id,
        names,
        {n: digests[n] for n in names},
        epoch=listing.epoch,
        expected=expected_entries(executor),
        timeout_s=timeout_s,
    )
    if init.mode == "weights":
        state = StageState(tensors=state.tensors, digests=state.digests, meta=None)
    try:
        restore_state(executor, state, complete=init.mode == "resume")
    except ValueError as exc:
        raise HandoverError(f"checkpoint does not fit stage [{first}, ...): {exc}") from None
    logger.info("stage [%d, ...) starts from checkpoint %s (%s)", first, init.state_digest[:12], init.mode)
    return len(state.tensors)


def snapshot_on_disk(
    executor: StageExecutor,
    job: JobSpec,
    *,
    epoch: int,
    progress: Mapping[str, int | float | str] | None = None,
) -> CheckpointFileSource:
    """The stage's state now, written to a temporary file and served from there, page by page.

    Why: a copy in memory is a second full stage (parameters and optimizer state) on a peer whose cap
    was planned for one; the file is written from the live tensors one at a time and pages are read
    back by range (`CheckpointFileSource`). The file lives as long as the source: the server drops the
    source once two newer epochs are published, and the directory goes with it (or at exit).
    Call on the compute thread (the tensors must not change while they are written).
    """
    directory = Path(tempfile.mkdtemp(prefix="ravnest-snapshot-"))
    first = executor.config.first_layer_index
    try:
        path = write_checkpoint_file(
            directory / f"epoch-{epoch}.safetensors",
            live_tensors(executor),
            job=job,
            step=executor.num_steps,
            first_layer=first,
            end_layer=first + len(executor.module),
            meta=capture_meta(executor, progress),
            progress=progress,
        )
        source = CheckpointFileSource(path)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    weakref.finalize(source, shutil.rmtree, directory, True)
    return source


def _scalars(values: Mapping[str, Any]) -> dict[str, int | float | str]:
    out: dict[str, int | float | str] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, int | float | str):
            out[key] = value
    return out


async def attach_stage_state(runner: Any, service: StageService) -> StageStateHook:
    """Serve `service`'s stage, and checkpoint it when due, for the life of `runner.run()`.

    Chains onto ``service.on_step`` (after any hook already there, e.g. the replica averager's).
    """
    job: JobSpec = runner.job
    placement = runner.placement
    executor = service.executor
    members = {s.peer_id for cluster in job.assignment or () for s in cluster} | set(placement.peers)

    def progress() -> dict[str, int | float | str]:
        report = getattr(runner, "progress", None)
        if callable(report):
            return _scalars(report().model_dump(mode="json"))
        return {
            "optimizer_steps": executor.num_steps,
            "epoch": placement.epoch,
            "micro_batches_this_plan": service.stats.completed if service.is_first else 0,
        }

    hook = StageStateHook(
        runner.rpc,
        runner.dht,
        job,
        executor,
        epoch=placement.epoch,
        allowed=members | set(job.state_readers),
        tasks=runner._tasks,  # the runner's task owner closes the announcements with the run
        checkpoint=checkpoint_config_for(job, runner.checkpoint_dir),
        progress=progress,
    )
    if job.init_checkpoint is not None and executor.weight_version == 0:  # nothing restored it yet
        await init_from_checkpoint(runner.rpc, job, executor)
    await hook.start()
    previous: Callable[[int], Awaitable[None]] | None = service.on_step

    async def on_step(step: int) -> None:
        if previous is not None:
            await previous(step)
        await hook.on_step(step)

    service.on_step = on_step
    return hook
