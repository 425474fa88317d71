"""A new owner's layers from the newest checkpoint that covers them, fetched from the peers that wrote it.

When no live peer holds some layers any more (e.g. a full-swarm restart, or every replica of a stage
lost at once), their state comes from checkpoints. `fetch_from_checkpoints` finds, among the signed
``checkpoints`` announcements, the newest step whose checkpoints cover [first, end)
(`checkpoint_announce.newest_covering`), and pulls each piece from the peer that wrote it (its
`HandoverServer` serves its checkpoint files, `CheckpointRef`) or reads it from this peer's own disk.
A holder's listing must carry the announced manifest digest as its version and hash to the announced
``state_digest``, so a holder can serve only what it announced under its own signature; the bytes are
then checked against those digests as in any `fetch_state`.

The result is a `StageState` (merge with other pieces via `merge_states`, apply with
`restore_state`). The job supervisor's ``state_source.HandoverStateSource.from_checkpoint`` reads only
this peer's own checkpoints; this function extends that to the other peers' disks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from ravnest_p2p.training.checkpoint import (
    CheckpointAnnouncement,
    CheckpointError,
    checkpoint_manifest_path,
    job_digest,
    load_checkpoint,
    newest_covering,
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

__all__ = ["fetch_from_checkpoints"]

logger = logging.getLogger(__name__)


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
