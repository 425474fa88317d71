"""The real `resume.StateSource`: other peers' stage state over `handover.fetch_state`, and local checkpoints.

A fetch asks one previous owner for one layer range of the job on the plan epoch it held it on, checked
by the hand-over client (allow-list on the server, sizes, dtypes, shapes and digests on the client). The
previous owner's stage may still run for up to a poll period after the plan moved (it notices at its next
poll): its state then changes mid-transfer (`StateChanged`), or it does not yet let a peer of the new plan
in (`HandoverRefused`); the fetch is retried a few times, for a few seconds.

Checkpoints are read from this peer's own checkpoint directory (the one `stage_hook` writes to), newest
step first among those whose layer range covers the asked one: a peer restarted on the same disk resumes
its layers from there when no live peer holds them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path

from ravnest_p2p.training.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from ravnest_p2p.training.handover import HandoverRefused, StateChanged, fetch_state
from ravnest_p2p.training.stage_hook import CHECKPOINT_DIR_ENV
from ravnest_p2p.training.stage_state import StageState, names_in_layers
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import run_in_compute_thread

__all__ = ["HandoverStateSource"]

logger = logging.getLogger(__name__)

_RANGE_DIR = re.compile(r"^layers-(\d{1,9})-(\d{1,9})$")


class HandoverStateSource:
    """Fetches stage state from previous owners and local checkpoints (see module docstring).

    Args:
        rpc: this peer's RPC endpoint.
        checkpoint_dir: where this peer keeps checkpoints (None: the environment's, else none).
        attempts: fetch attempts per source while the owner's state changes mid-transfer, or while it
            refuses us (it has not yet seen the plan that lets us in).
        timeout_s: deadline of one fetch.
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        *,
        checkpoint_dir: Path | None = None,
        attempts: int = 5,
        timeout_s: float = 60.0,
    ) -> None:
        self.rpc = rpc
        env = os.environ.get(CHECKPOINT_DIR_ENV)
        self.checkpoint_dir = checkpoint_dir or (Path(env) if env else None)
        self.attempts = attempts
        self.timeout_s = timeout_s

    async def fetch(
        self,
        peer_id: str,
        *,
        job_id: str,
        epoch: int,
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
                logger.debug("state of %s not fetched (attempt %d): %r", peer_id, attempt + 1, exc)
                await asyncio.sleep(min(0.5 * (attempt + 1), 2.0))  # it is about to see the new plan
        return None

    async def from_checkpoint(self, *, job_id: str, first_layer: int, end_layer: int) -> StageState | None:
        if self.checkpoint_dir is None:
            return None
        return await run_in_compute_thread(self._newest, self.checkpoint_dir / job_id, first_layer, end_layer)

    @staticmethod
    def _newest(directory: Path, first_layer: int, end_layer: int) -> StageState | None:
        if not directory.is_dir():
            return None
        found: list[tuple[int, Path]] = []
        for sub in directory.iterdir():
            match = _RANGE_DIR.match(sub.name)
            if match and int(match[1]) <= first_layer and end_layer <= int(match[2]):
                found += [(int(p.stem[5:]), p) for p in list_checkpoints(sub)]
        for _, path in sorted(found, reverse=True):
            try:
                _, state = load_checkpoint(path)
            except CheckpointError as exc:
                logger.info("checkpoint %s unusable: %s", path, exc)
                continue
            return state.subset(names_in_layers(state.tensors, first_layer, end_layer))
        return None
