"""Where a new owner's state comes from: a previous owner's live stage, or the newest checkpoint.

This is the seam the job supervisor calls on a re-plan (its ``resume.StateSource`` protocol:
``fetch(peer_id, job_id=, first_layer=, end_layer=, allowed=)`` and ``from_checkpoint(job_id=,
first_layer=, end_layer=)``), built on `handover.fetch_state`:

- `HandoverStateSource.fetch` pulls layers [first, end) of a previous owner's published stage (only
  from peers in `allowed`), checked against the receiver's schema when it is given one.
- `fetch_from_checkpoints` finds, among the signed ``checkpoints`` announcements, the newest step whose
  checkpoints cover [first, end) (`newest_covering`), and pulls each piece from the peer that wrote
  it (a checkpoint file served by its `HandoverServer`) or reads it from this peer's own disk. A
  holder's listing must carry the announced manifest digest as its version and hash to the announced
  ``state_digest``, so a holder can serve only what it announced under its own signature.

Both return the `StageState` (tensors by global name, digests, counters); apply it with
`stage_state.restore_state` (optimizer state included) after merging the pieces with `merge_states`.
The returned dict (``{"tensors", "digests", "meta", "stage_state"}``) also fits the supervisor's
``HeldState`` shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ravnest_p2p.training.checkpoint import (
    CheckpointAnnouncement,
    CheckpointError,
    checkpoint_manifest_path,
    job_digest,
    load_checkpoint,
    newest_covering,
    read_announcements,
)
from ravnest_p2p.training.handover import (
    CheckpointRef,
    CorruptState,
    HandoverError,
    fetch_state,
    list_state,
)
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stage_state import (
    StageState,
    TensorEntry,
    entries_digest,
    merge_states,
    names_in_layers,
)
from ravnest_p2p.transport.rpc import RpcEndpoint

__all__ = ["HandoverStateSource", "fetch_from_checkpoints", "held_state"]

logger = logging.getLogger(__name__)


def held_state(state: StageState) -> dict[str, Any]:
    """A `StageState` in the supervisor's ``HeldState`` shape (``tensors`` by global name, and more)."""
    return {"tensors": state.tensors, "digests": state.digests, "meta": state.meta, "stage_state": state}


async def fetch_from_checkpoints(
    rpc: RpcEndpoint,
    announcements: Sequence[CheckpointAnnouncement],
    job: JobSpec,
    first_layer: int,
    end_layer: int,
    *,
    expected: Mapping[str, TensorEntry] | None = None,
    local_root: Path | None = None,
    timeout_s: float = 120.0,
) -> StageState | None:
    """Layers [first_layer, end_layer) from the newest checkpoint step that covers them (None: none does).

    Raises:
        HandoverError: a holder refused or sent something that does not verify (the caller may try an
            older source; nothing was changed).
    """
    found = newest_covering(
        announcements,
        job_id=job.job_id,
        first_layer=first_layer,
        end_layer=end_layer,
        job_digest=job_digest(job),
    )
    if found is None:
        return None
    step, holders = found
    parts = []
    for peer_id, record in holders:
        lo, hi = max(first_layer, record.first_layer), min(end_layer, record.end_layer)
        ref = CheckpointRef(step=step, first_layer=record.first_layer, end_layer=record.end_layer)
        if peer_id == rpc.peer_id and local_root is not None:
            path = checkpoint_manifest_path(
                local_root, job.job_id, step=step, first_layer=record.first_layer, end_layer=record.end_layer
            )
            try:
                _, whole = load_checkpoint(path, job=job, manifest_digest=record.manifest_digest)
            except CheckpointError as exc:
                raise HandoverError(f"own checkpoint {step} of [{lo}, {hi}): {exc}") from None
            parts.append(whole.subset(names_in_layers(whole.tensors, lo, hi)))
            continue
        listing = await list_state(
            rpc,
            peer_id,
            job.job_id,
            layers=(record.first_layer, record.end_layer),
            checkpoint=ref,
            timeout_s=timeout_s,
        )
        if listing.version != record.manifest_digest or (
            record.state_digest and entries_digest(listing.entries) != record.state_digest
        ):
            raise CorruptState(f"{peer_id} serves another checkpoint {step} than it announced")
        digests = {e.name: e.digest for e in listing.entries}
        names = names_in_layers(digests, lo, hi)
        parts.append(
            await fetch_state(
                rpc,
                peer_id,
                job.job_id,
                names,
                {n: digests[n] for n in names},
                checkpoint=ref,
                expected=expected,
                timeout_s=timeout_s,
            )
        )
    return merge_states(parts)


class HandoverStateSource:
    """`fetch_state` and checkpoints behind the supervisor's ``StateSource`` protocol.

    Args:
        rpc: this peer's endpoint.
        dht: where ``checkpoints`` announcements are read (anything with ``get_signed``; None: none).
        job: the job (checkpoints are matched by its spec's digest).
        expected: the new stage's schema (`stage_state.expected_entries`), if known.
        checkpoint_root: this peer's own checkpoint folder (read directly, not over the network).
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        dht: Any,
        job: JobSpec,
        *,
        expected: Mapping[str, TensorEntry] | None = None,
        checkpoint_root: Path | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        self.rpc = rpc
        self.dht = dht
        self.job = job
        self.expected = expected
        self.checkpoint_root = checkpoint_root
        self.timeout_s = timeout_s

    async def fetch(
        self, peer_id: str, *, job_id: str, first_layer: int, end_layer: int, allowed: Iterable[str]
    ) -> dict[str, Any] | None:
        if peer_id not in set(allowed) or job_id != self.job.job_id:
            return None
        state = await fetch_state(
            self.rpc,
            peer_id,
            job_id,
            layers=(first_layer, end_layer),
            expected=self.expected,
            timeout_s=self.timeout_s,
        )
        return held_state(state) if state.tensors else None

    async def from_checkpoint(
        self, *, job_id: str, first_layer: int, end_layer: int
    ) -> dict[str, Any] | None:
        if job_id != self.job.job_id or self.dht is None:
            return None
        announcements = await read_announcements(self.dht, job_id=job_id)
        state = await fetch_from_checkpoints(
            self.rpc,
            announcements,
            self.job,
            first_layer,
            end_layer,
            expected=self.expected,
            local_root=self.checkpoint_root,
            timeout_s=self.timeout_s,
        )
        return held_state(state) if state is not None else None
