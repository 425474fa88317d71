"""The real `resume.StateSource`: other peers' stage state over `handover.fetch_state`, and checkpoints.

A fetch asks one previous owner for one layer range of the job on the plan epoch it held it on, checked
by the hand-over client (allow-list on the server, sizes, dtypes, shapes and digests on the client). The
previous owner's stage may still run for up to a poll period after the plan moved (it notices at its next
poll): its state then changes mid-transfer (`StateChanged`), or it does not yet let a peer of the new plan
in (`HandoverRefused` "not allowed"); the fetch is retried a few times, for a few seconds. An owner that
holds no such state (e.g. it restarted) is not asked again.

Checkpoints: the step is the newest one complete across the whole model (`complete_steps`) among the
signed ``checkpoints`` announcements of the plan's members and this peer's own disk (every layer range
it ever wrote, `checkpoint_fetch.local_announcement`), so every stage of a restarted job resumes from
the same step. Its pieces come from this peer's own files first, else from the members that announced
them (`checkpoint_fetch.fetch_from_checkpoints`: digests against the signed announcement, pages). Holders
that only refuse or cannot be reached are asked again for up to `checkpoint_wait_s` (after a full restart
each serves its files once it knows the new plan); a step whose pieces cannot all be had then costs
that step, and the next older complete one is tried. With no
complete step at all, the newest checkpoint that covers the asked layers is used (logged).

`share_checkpoints` serves this peer's checkpoint files of a job to the plan's members before any stage
runs here: after a full restart no stage serves them yet, and every peer needs the others' pieces.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from pathlib import Path
from typing import Any

from ravnest_p2p.training.checkpoint import (
    CheckpointAnnouncement,
    CheckpointError,
    complete_steps,
    job_digest,
    read_announcements,
)
from ravnest_p2p.training.checkpoint_fetch import (
    CheckpointUnavailable,
    announce_disk,
    fetch_from_checkpoints,
    local_announcement,
)
from ravnest_p2p.training.handover import (
    HandoverError,
    HandoverRefused,
    HandoverServer,
    StateChanged,
    fetch_state,
)
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.resume import CheckpointQuery
from ravnest_p2p.training.stage_hook import CHECKPOINT_DIR_ENV
from ravnest_p2p.training.stage_state import StageState
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import run_in_compute_thread

__all__ = ["HandoverStateSource"]

logger = logging.getLogger(__name__)

_STEPS_TRIED = 3  # complete steps tried, newest first, before the layers start from the initial weights


class HandoverStateSource:
    """Fetches stage state from previous owners and checkpoints (see module docstring).

    Args:
        rpc: this peer's RPC endpoint.
        dht: where the run's ``checkpoints`` announcements are read (None: this peer's own disk only).
        checkpoint_dir: where this peer keeps checkpoints (None: the environment's, else none).
        attempts: fetch attempts per source while the owner's state changes mid-transfer, or while it
            refuses us (it has not yet seen the plan that lets us in).
        timeout_s: deadline of one fetch.
        checkpoint_wait_s: how long the holders of a checkpoint step that only refuse or cannot be reached
            are asked again before an older step is tried.
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        *,
        dht: Any = None,
        checkpoint_dir: Path | None = None,
        attempts: int = 5,
        timeout_s: float = 60.0,
        checkpoint_wait_s: float = 30.0,
    ) -> None:
        self.rpc = rpc
        self.dht = dht
        env = os.environ.get(CHECKPOINT_DIR_ENV)
        self.checkpoint_dir = checkpoint_dir or (Path(env) if env else None)
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.checkpoint_wait_s = checkpoint_wait_s

    async def fetch(
        self,
        peer_id: str,
        *,
        job_id: str,
        epoch: int | None,
        first_layer: int,
        end_layer: int,
        allowed: frozenset[str],
    ) -> StageState | None:
        if peer_id not in allowed or peer_id == self.rpc.peer_id:
            return None
        for attempt in range(self.attempts):
            try:
                return await fetch_state(
                    self.rpc,
                    peer_id,
                    job_id,
                    layers=(first_layer, end_layer),
                    epoch=epoch,
                    timeout_s=self.timeout_s,
                )
            except (StateChanged, HandoverRefused) as exc:
                if isinstance(exc, HandoverRefused) and exc.code == "no_state":
                    logger.debug("%s holds no state of job %s at epoch %s", peer_id, job_id, epoch)
                    return None  # it never ran that plan here (e.g. restarted): asking again won't help
                logger.debug("state of %s not fetched (attempt %d): %r", peer_id, attempt + 1, exc)
                await asyncio.sleep(min(0.5 * (attempt + 1), 2.0))  # it is about to see the new plan
        return None

    async def announce_checkpoints(self, job: JobSpec) -> None:
        """Announce every checkpoint of `job` on this peer's disk (once per job and process, before the
        peer plans it): a restarted peer's last checkpoint may never have been announced (the announcement
        is sent after the save, and a SIGTERM can end the run first), and stages that choose the newest
        complete step from different announcements resume from different steps."""
        if self.checkpoint_dir is None or self.dht is None:
            return
        await announce_disk(self.dht, self.checkpoint_dir, job, self.rpc.peer_id)

    async def share_checkpoints(self, job_id: str, peer_ids: frozenset[str]) -> None:
        if self.checkpoint_dir is None:
            return
        server = HandoverServer.of(self.rpc)
        await server.start()
        server.serve_checkpoints(job_id, self.checkpoint_dir, allowed=peer_ids)

    async def from_checkpoint(
        self, query: CheckpointQuery, *, first_layer: int, end_layer: int
    ) -> StageState | None:
        job = query.job
        announcements = await self._announcements(query)
        steps = complete_steps(
            announcements, job_id=job.job_id, num_layers=query.num_layers, job_digest=job_digest(job)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.checkpoint_wait_s
        for step in steps[:_STEPS_TRIED]:
            try:
                state = await self._fetch_waiting(
                    announcements, query, first_layer, end_layer, step, deadline
                )
            except (HandoverError, CheckpointError) as exc:
                logger.warning(
                    "job %s: checkpoint %d of layers %d-%d unusable: %s",
                    job.job_id,
                    step,
                    first_layer,
                    end_layer,
                    exc,
                )
                continue
            if state is not None:
                logger.info(
                    "job %s: layers %d-%d from checkpoint step %d (complete across stages)",
                    job.job_id,
                    first_layer,
                    end_layer,
                    step,
                )
                return state
        if steps:
            return None  # complete steps exist but none could be had: no step stitched from others
        state = await self._fetch(announcements, query, first_layer, end_layer, None)
        if state is not None:
            logger.warning(
                "job %s: no checkpoint step is complete across stages; layers %d-%d from the "
                "newest checkpoint that covers them (step %s)",
                job.job_id,
                first_layer,
                end_layer,
                state.meta.num_steps if state.meta else "?",
            )
        return state

    async def _fetch_waiting(
        self,
        announcements: list[CheckpointAnnouncement],
        query: CheckpointQuery,
        first_layer: int,
        end_layer: int,
        step: int,
        deadline: float,
    ) -> StageState | None:
        """`_fetch` of `step`, asked again while its holders only refuse or are unreachable, until
        `deadline` (loop time): after a full restart, a holder serves its files once it knows its role."""
        loop = asyncio.get_running_loop()
        for attempt in itertools.count():
            try:
                return await self._fetch(announcements, query, first_layer, end_layer, step)
            except CheckpointUnavailable as exc:
                pause = min(0.5 * (attempt + 1), 2.0)
                if not exc.transient or loop.time() + pause > deadline:
                    raise
                logger.info(
                    "checkpoint %d of layers %d-%d: asking again (%s)", step, first_layer, end_layer, exc
                )
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def _fetch(
        self,
        announcements: list[CheckpointAnnouncement],
        query: CheckpointQuery,
        first_layer: int,
        end_layer: int,
        step: int | None,
    ) -> StageState | None:
        return await fetch_from_checkpoints(
            self.rpc,
            announcements,
            query.job,
            first_layer,
            end_layer,
            step=step,
            local_root=self.checkpoint_dir,
            timeout_s=self.timeout_s,
        )

    async def _announcements(self, query: CheckpointQuery) -> list[CheckpointAnnouncement]:
        """The members' announcements of the job, and this peer's own disk in place of its own."""
        me = self.rpc.peer_id
        out: list[CheckpointAnnouncement] = []
        if self.dht is not None:
            try:
                found = await read_announcements(self.dht, job_id=query.job.job_id)
            except Exception as exc:  # the DHT may be unreachable: this peer's own disk still counts
                logger.info("checkpoint announcements unreadable: %r", exc)
                found = []
            out = [a for a in found if a.peer_id in query.members and a.peer_id != me]
        if self.checkpoint_dir is not None:
            own = await run_in_compute_thread(local_announcement, self.checkpoint_dir, query.job, me)
            if own is not None:
                out.append(own)
        return out
