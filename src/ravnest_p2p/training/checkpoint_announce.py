"""Signed announcements of stage checkpoints, and the newest step that covers a layer range.

Every stage owner keeps one value under its own signed subkey of the run's ``checkpoints`` key: the
job, and the (step, layer range, manifest digest, state digest) of each checkpoint it keeps. Readers
keep only values signed by the peer they name. `newest_covering` (pure) picks, for a layer range, the
newest step whose checkpoints cover it; `newest_complete` does so for the whole model, and
`complete_steps` lists every step complete across the whole model, newest first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from ravnest_p2p.training.progress import ProgressStore
from ravnest_p2p.training.stage_state import entries_digest
from ravnest_p2p.types import WireModel

if TYPE_CHECKING:
    from ravnest_p2p.training.checkpoint import CheckpointManifest

__all__ = [
    "CHECKPOINTS_KEY",
    "CheckpointAnnouncement",
    "CheckpointRecord",
    "announce_checkpoints",
    "complete_steps",
    "newest_complete",
    "newest_covering",
    "parse_announcement",
    "read_announcements",
]

logger = logging.getLogger(__name__)

CHECKPOINTS_KEY = "checkpoints"


class CheckpointRecord(WireModel):
    """One checkpoint: its step and layers, its manifest's digest and the digest of its tensor list."""

    step: int = Field(ge=0)
    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1)
    manifest_digest: str = Field(min_length=1, max_length=64)
    state_digest: str = Field(default="", max_length=64)  # `stage_state.entries_digest` of its tensors


class CheckpointAnnouncement(WireModel):
    """A stage owner's checkpoints of a job, under its own signed subkey of ``checkpoints``."""

    schema_version: int = 1
    job_id: str = Field(max_length=64)
    job_digest: str = Field(max_length=64)
    peer_id: str = Field(max_length=128)
    checkpoints: tuple[CheckpointRecord, ...] = Field(default=(), max_length=64)
    updated_at: float = 0.0

    @classmethod
    def of(
        cls, manifests: Iterable[CheckpointManifest], *, peer_id: str, updated_at: float
    ) -> CheckpointAnnouncement:
        listed = list(manifests)
        assert listed, "announce at least one checkpoint"
        return cls(
            job_id=listed[0].job_id,
            job_digest=listed[0].job_digest,
            peer_id=peer_id,
            checkpoints=tuple(
                CheckpointRecord(
                    step=m.step,
                    first_layer=m.first_layer,
                    end_layer=m.end_layer,
                    manifest_digest=m.digest(),
                    state_digest=entries_digest(m.tensors.values()),
                )
                for m in listed[-64:]
            ),
            updated_at=updated_at,
        )


def _by_step(
    announcements: Sequence[CheckpointAnnouncement], job_id: str, job_digest: str | None
) -> dict[int, list[tuple[str, CheckpointRecord]]]:
    by_step: dict[int, list[tuple[str, CheckpointRecord]]] = {}
    for announcement in announcements:
        if announcement.job_id != job_id or (
            job_digest is not None and announcement.job_digest != job_digest
        ):
            continue
        for record in announcement.checkpoints:
            if record.end_layer > record.first_layer:
                by_step.setdefault(record.step, []).append((announcement.peer_id, record))
    return by_step


def _cover(
    held: Sequence[tuple[str, CheckpointRecord]], first_layer: int, end_layer: int
) -> list[tuple[str, CheckpointRecord]] | None:
    """Records covering [first_layer, end_layer) in layer order (at each point the one reaching
    furthest), or None."""
    chosen: list[tuple[str, CheckpointRecord]] = []
    covered = first_layer
    while covered < end_layer:
        candidates = [h for h in held if h[1].first_layer <= covered < h[1].end_layer]
        if not candidates:
            return None
        best = max(candidates, key=lambda h: (h[1].end_layer, h[0]))
        chosen.append(best)
        covered = best[1].end_layer
    return chosen


def newest_covering(
    announcements: Sequence[CheckpointAnnouncement],
    *,
    job_id: str,
    first_layer: int,
    end_layer: int,
    job_digest: str | None = None,
) -> tuple[int, list[tuple[str, CheckpointRecord]]] | None:
    """The newest step whose checkpoints cover layers [first_layer, end_layer), and who holds them.

    Returns (step, [(peer id, record), ...]) with records chosen to cover the range in layer order (at
    each point the one reaching furthest), or None when no step covers it. Pure.
    """
    by_step = _by_step(announcements, job_id, job_digest)
    for step in sorted(by_step, reverse=True):
        chosen = _cover(by_step[step], first_layer, end_layer)
        if chosen is not None:
            return step, chosen
    return None


def complete_steps(
    announcements: Sequence[CheckpointAnnouncement],
    *,
    job_id: str,
    num_layers: int,
    job_digest: str | None = None,
) -> list[int]:
    """Every step whose checkpoints cover the whole model [0, num_layers), newest first. Pure."""
    by_step = _by_step(announcements, job_id, job_digest)
    return [s for s in sorted(by_step, reverse=True) if _cover(by_step[s], 0, num_layers) is not None]


def newest_complete(
    announcements: Sequence[CheckpointAnnouncement],
    *,
    job_id: str,
    num_layers: int,
    job_digest: str | None = None,
) -> tuple[int, list[tuple[str, CheckpointRecord]]] | None:
    """The newest step complete across the whole model (a full-swarm restart): `newest_covering` of
    layers [0, num_layers)."""
    return newest_covering(
        announcements, job_id=job_id, first_layer=0, end_layer=num_layers, job_digest=job_digest
    )


def parse_announcement(value: Any, signer_peer_id: str) -> CheckpointAnnouncement:
    """The DHT validator's schema of the ``checkpoints`` key: a valid announcement its signer wrote about
    itself (register with ``KeyRegistry.with_schema(CHECKPOINTS_KEY, parse_announcement)``)."""
    announcement = CheckpointAnnouncement.model_validate(value)
    if announcement.peer_id != signer_peer_id:
        raise ValueError(
            f"announcement names {announcement.peer_id[:16]!r}, signed by {signer_peer_id[:16]!r}"
        )
    return announcement


async def announce_checkpoints(
    dht: ProgressStore, announcement: CheckpointAnnouncement, *, ttl_s: float = 3600.0
) -> bool:
    """Store `announcement` under our own signed subkey of ``checkpoints``; True if a replica took it.

    Pinned at the initial peers too: after every peer restarted, the key's replicas may all be restarted
    peers, and stages that read different sets of announcements chose different "newest complete" steps
    (a full-restart run resumed one stage from step 64 and the next from step 48).
    """
    return await dht.store_own(
        CHECKPOINTS_KEY, announcement.model_dump(mode="json"), ttl_s=ttl_s, pin_to_initial_peers=True
    )


async def read_announcements(
    dht: ProgressStore, *, job_id: str | None = None
) -> list[CheckpointAnnouncement]:
    """Valid announcements (of `job_id`), each signed by the peer it names; malformed ones are dropped."""
    out = []
    for signer, (value, _) in (await dht.get_signed(CHECKPOINTS_KEY, from_initial_peers=True)).items():
        try:
            announcement = CheckpointAnnouncement.model_validate(value)
        except Exception as exc:
            logger.debug("ignoring a malformed checkpoint announcement from %s: %s", signer, exc)
            continue
        if announcement.peer_id == signer and (job_id is None or announcement.job_id == job_id):
            out.append(announcement)
    return out
