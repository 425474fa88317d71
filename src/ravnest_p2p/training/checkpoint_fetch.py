"""A new owner's layers from a checkpoint step, read from this peer's disk or fetched from the peers that
wrote it.

When no live peer holds some layers any more (e.g. a full-swarm restart, or every replica of a stage
lost at once), their state comes from checkpoints. `fetch_from_checkpoints` takes, among the signed
``checkpoints`` announcements, a given step (`checkpoint_announce.complete_steps` lists the steps
complete across the whole model) or else the newest step whose checkpoints cover [first, end)
(`checkpoint_announce.newest_covering`), and assembles the range piece by piece: this peer's own
file first (`local_root`), else the peer that wrote the piece (its `HandoverServer` serves its
checkpoint files, `CheckpointRef`); a holder that fails or does not verify costs that holder, and the
next one holding the same layers at that step is asked. When none answers, `CheckpointUnavailable`
says whether they only refused or were unreachable (`transient`: after a full restart a holder serves
its files only once it knows the new plan) or something did not verify.

Checks: a holder's listing must carry the announced manifest digest as its version and hash to the
announced ``state_digest``, so a holder can serve only what it announced under its own signature; the
bytes are then checked against those digests as in any `fetch_state`. A file on this peer's disk is
verified by `load_checkpoint` against the announced manifest digest and the job's digest.

Memory: a remote piece arrives in pages (`fetch_state`); a local file is read one tensor at a time,
and only the tensors of the asked layers are kept (the others are hashed, not held). The result is a
`StageState` (apply with `restore_state`).

`local_announcement` lists this peer's own checkpoints of a job (every layer range it ever wrote) as
an announcement, so a restarted peer counts what its disk holds even when its published value is gone
or names only its last range.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ravnest_p2p.training.checkpoint import (
    CheckpointAnnouncement,
    CheckpointError,
    CheckpointManifest,
    CheckpointRecord,
    checkpoint_manifest_path,
    job_digest,
    list_checkpoints,
    load_checkpoint,
    newest_covering,
    read_manifest,
)
from ravnest_p2p.training.checkpoint_announce import announce_checkpoints
from ravnest_p2p.training.handover import (
    CheckpointRef,
    CorruptState,
    HandoverError,
    HandoverRefused,
    fetch_state,
    list_state,
)
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.progress import ProgressStore
from ravnest_p2p.training.stage_state import (
    StageState,
    TensorEntry,
    entries_digest,
    merge_states,
    names_in_layers,
)
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import run_in_compute_thread

__all__ = ["CheckpointUnavailable", "announce_disk", "fetch_from_checkpoints", "local_announcement"]

logger = logging.getLogger(__name__)

_MAX_RECORDS = 64  # `CheckpointAnnouncement.checkpoints` holds at most this many


async def fetch_from_checkpoints(
    rpc: RpcEndpoint,
    announcements: Sequence[CheckpointAnnouncement],
    job: JobSpec,
    first_layer: int,
    end_layer: int,
    *,
    step: int | None = None,
    expected: Mapping[str, TensorEntry] | None = None,
    local_root: Path | None = None,
    timeout_s: float = 120.0,
) -> StageState | None:
    """Layers [first_layer, end_layer) from checkpoint `step` (None: the newest step that covers them).

    Returns None when that step (or no step) covers the range. Only announcements of `job` (its id and
    digest) count; the caller filters them to the peers it trusts.

    Raises:
        CheckpointUnavailable: every holder of some layers failed or sent something that does not verify
            (the caller may ask again, or try an older step; nothing was changed).
    """
    digest = job_digest(job)
    mine = [a for a in announcements if a.job_id == job.job_id and a.job_digest == digest]
    if step is None:
        found = newest_covering(mine, job_id=job.job_id, first_layer=first_layer, end_layer=end_layer)
        if found is None:
            return None
        step = found[0]
    held = [
        (a.peer_id, r) for a in mine for r in a.checkpoints if r.step == step and r.end_layer > r.first_layer
    ]
    own = rpc.peer_id if local_root is not None else None
    parts: list[StageState] = []
    covered = first_layer
    while covered < end_layer:
        # this peer's disk first, then whoever reaches furthest (fewest pieces), by peer id
        candidates = sorted(
            (h for h in held if h[1].first_layer <= covered < h[1].end_layer),
            key=lambda h: (h[0] != own, -h[1].end_layer, h[0]),
        )
        if not candidates:
            if not parts:
                return None
            raise HandoverError(f"checkpoint {step} does not cover layer {covered}")
        failures: list[str] = []
        transient = True
        for peer_id, record in candidates:
            hi = min(end_layer, record.end_layer)
            try:
                if peer_id == own:
                    assert local_root is not None
                    part = await run_in_compute_thread(_read_own, local_root, job, record, covered, hi)
                else:
                    part = await _fetch_piece(rpc, peer_id, job, record, covered, hi, expected, timeout_s)
            except (HandoverError, CheckpointError) as exc:
                logger.info("checkpoint %d of layers [%d, %d) from %s: %s", step, covered, hi, peer_id, exc)
                failures.append(f"{peer_id[:16]}: {exc}")
                transient = transient and _transient(exc)
                continue
            parts.append(part)
            covered = hi
            break
        else:
            raise CheckpointUnavailable(
                f"no holder of checkpoint {step} of layer {covered} answered: {failures}", transient=transient
            )
    return merge_states(parts)


class CheckpointUnavailable(HandoverError):
    """No holder of some piece of a checkpoint step answered with it.

    Attributes:
        transient: every holder only refused or could not be reached (e.g. it restarted and does not
            serve its checkpoints yet): asking again a little later may succeed. False once a holder
            sent or kept something that does not verify.
    """

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


def _transient(exc: Exception) -> bool:
    if isinstance(exc, HandoverRefused):
        return exc.code in ("not_allowed", "no_state")  # not (yet) serving us: it learns the plan soon
    return type(exc) is HandoverError  # the transport, or the deadline


def _read_own(root: Path, job: JobSpec, record: CheckpointRecord, lo: int, hi: int) -> StageState:
    path = checkpoint_manifest_path(
        root, job.job_id, step=record.step, first_layer=record.first_layer, end_layer=record.end_layer
    )
    _, state = load_checkpoint(path, job=job, manifest_digest=record.manifest_digest, layers=(lo, hi))
    return state


async def _fetch_piece(
    rpc: RpcEndpoint,
    peer_id: str,
    job: JobSpec,
    record: CheckpointRecord,
    lo: int,
    hi: int,
    expected: Mapping[str, TensorEntry] | None,
    timeout_s: float,
) -> StageState:
    ref = CheckpointRef(step=record.step, first_layer=record.first_layer, end_layer=record.end_layer)
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
        raise CorruptState(f"{peer_id} serves another checkpoint {record.step} than it announced")
    digests = {e.name: e.digest for e in listing.entries}
    names = names_in_layers(digests, lo, hi)
    return await fetch_state(
        rpc,
        peer_id,
        job.job_id,
        names,
        {n: digests[n] for n in names},
        checkpoint=ref,
        expected=expected,
        timeout_s=timeout_s,
    )


def local_announcement(root: Path, job: JobSpec, peer_id: str) -> CheckpointAnnouncement | None:
    """This peer's checkpoints of `job` under `root` (a `CheckpointConfig.dir`), every layer range, as an
    announcement (never published: it only joins the others' when a step is chosen). Blocking I/O."""
    digest = job_digest(job)
    directory = root / job.job_id
    manifests: list[CheckpointManifest] = []
    if directory.is_dir():
        for sub in sorted(directory.iterdir()):
            for path in list_checkpoints(sub):
                try:
                    manifest = read_manifest(path)
                except CheckpointError as exc:
                    logger.info("checkpoint %s unreadable: %s", path, exc)
                    continue
                if (
                    manifest.kind == "stage"
                    and manifest.job_id == job.job_id
                    and manifest.job_digest == digest
                    and path
                    == checkpoint_manifest_path(
                        root,
                        job.job_id,
                        step=manifest.step,
                        first_layer=manifest.first_layer,
                        end_layer=manifest.end_layer,
                    )
                ):
                    manifests.append(manifest)
    if not manifests:
        return None
    manifests.sort(key=lambda m: (m.step, m.first_layer, m.end_layer))
    return CheckpointAnnouncement.of(manifests[-_MAX_RECORDS:], peer_id=peer_id, updated_at=time.time())


async def announce_disk(dht: ProgressStore, root: Path, job: JobSpec, peer_id: str) -> bool:
    """Announce every checkpoint of `job` this peer's disk under `root` holds (`local_announcement`), each
    layer range it ever wrote: an announcement replaces the peer's previous one, so announcing only the
    current stage's range would hide the others. False if there is none or no replica took it."""
    announcement = await run_in_compute_thread(local_announcement, root, job, peer_id)
    if announcement is None:
        return False
    return await announce_checkpoints(dht, announcement)
