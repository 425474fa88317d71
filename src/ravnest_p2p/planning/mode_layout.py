"""Which peers are the workers of a ``sync_backup`` or ``ist`` job, and which of them own shards.

Problem. In both modes a worker holds the whole model (``sync_backup``) or a replica plus the
sub-network it trains (``ist``), so the pipeline planner's question (how to cut the layers over a
cluster) does not arise; the questions are which peers can hold a worker at all, which of them to use,
and (``sync_backup``) which of them aggregate parameter shards. The researcher used to answer them by
hand in an explicit assignment.

Rule (pure, deterministic, over the peers' measured figures):
- A peer can be a worker when its free memory covers one worker's need (`need_bytes`, computed by the
  caller with the pipeline planner's memory model, `planning.memory`, for a window of one).
- The eligible peers are ranked by their estimated time for one worker step: the step's compute at the
  peer's measured FLOP/s plus the step's exchange (`exchange_bytes`, about one gradient or sub-network
  each way) at the slower direction of its link; ties by peer id. The first ``count`` are the workers,
  fastest first; a worker's index (its data slot) is its rank.
- ``sync_backup``: the N + b fastest are the workers, so the b slowest of them are the ones whose
  gradients arrive late and get dropped; the N fastest are the shard owners (`SyncBackupConfig.owners`,
  `strategies.sync_layout`): an owner on a slow peer delays every step. With b = 0 every worker may own
  (owners None, the layout's default).
- ``ist``: the n fastest are the workers (every worker trains an equal part each round, so the slowest
  worker sets the round time: leaving slow peers out is the whole gain).

Alternatives rejected. Running the pipeline planner and reading its clusters: it packs layers by memory
and stage time and makes multi-stage clusters where one peer would hold the model. Ranking by FLOP/s
alone: a worker on a slow link delivers its gradient late every step whatever its FLOP/s (on the lab
a shard owner's link set the step's exchange time, `strategies.sync_layout`).

Known limits. A worker is always one peer: when no peer can hold a worker the layout fails with
`WorkerDoesNotFit` (use mode ``pipeline``, whose clusters split the model over peers). A worker that is
itself a pipeline cluster is not built. Pairwise link measurements are not used, only each peer's own
up/down figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ravnest_p2p.planning.types import InfeasiblePlan, PeerCapacity

__all__ = ["ModeLayout", "WorkerDoesNotFit", "ist_layout", "rank_workers", "sync_backup_layout"]

_GIB = 2**30
_ADVICE = "use mode pipeline (its clusters split the model over peers), or a smaller model or batch"


class WorkerDoesNotFit(InfeasiblePlan):
    """No peer can hold one worker of the mode (the model, or the sub-network, is too big for one peer)."""


@dataclasses.dataclass(frozen=True)
class ModeLayout:
    """The workers of a job (fastest first: a worker's index is its data slot) and the shard owners.

    Attributes:
        workers: the chosen peers, fastest first.
        owners: ``sync_backup`` shard owners (the N fastest) when there are backups; None: every worker.
        need_bytes: what one worker needs (headroom included), as the layout was computed with.
    """

    workers: tuple[str, ...]
    owners: tuple[str, ...] | None
    need_bytes: int


def _step_time_s(peer: PeerCapacity, compute_flops: float, exchange_bytes: float) -> float:
    return compute_flops / peer.flops_per_s + exchange_bytes / peer.link_bytes_per_s


def rank_workers(
    peers: Sequence[PeerCapacity], *, need_bytes: int, compute_flops: float = 0.0, exchange_bytes: float = 0.0
) -> list[PeerCapacity]:
    """The peers that can hold a worker (memory >= `need_bytes`), fastest estimated step first.

    With no compute and no exchange given, the ranking is by FLOP/s. Ties by peer id.
    """
    fit = [p for p in peers if p.memory_bytes >= need_bytes]
    if compute_flops <= 0 and exchange_bytes <= 0:
        return sorted(fit, key=lambda p: (-p.flops_per_s, p.peer_id))
    return sorted(fit, key=lambda p: (_step_time_s(p, compute_flops, exchange_bytes), p.peer_id))


def _pick(
    peers: Sequence[PeerCapacity],
    count: int,
    *,
    need_bytes: int,
    compute_flops: float,
    exchange_bytes: float,
    what: str,
    advice: str,
) -> tuple[str, ...]:
    if count < 1:
        raise ValueError(f"{what}: need at least one worker, got {count}")
    ranked = rank_workers(
        peers, need_bytes=need_bytes, compute_flops=compute_flops, exchange_bytes=exchange_bytes
    )
    largest = max((p.memory_bytes for p in peers), default=0)
    if not ranked:
        raise WorkerDoesNotFit(
            f"the model does not fit on one peer: a {what} worker needs {need_bytes / _GIB:.2f} GiB but "
            f"the largest of the {len(peers)} peers offers {largest / _GIB:.2f} GiB; {advice}"
        )
    if len(ranked) < count:
        raise InfeasiblePlan(
            f"{what} needs {count} workers of {need_bytes / _GIB:.2f} GiB each but only {len(ranked)} of "
            f"the {len(peers)} peers can hold one: ask for fewer workers or wait for more peers"
        )
    return tuple(p.peer_id for p in ranked[:count])


def sync_backup_layout(
    peers: Sequence[PeerCapacity],
    *,
    num_required: int,
    num_backup: int,
    need_bytes: int,
    compute_flops: float = 0.0,
    exchange_bytes: float = 0.0,
) -> ModeLayout:
    """The N + b workers of a ``sync_backup`` job and its shard owners (see the module docstring).

    Raises:
        WorkerDoesNotFit: no peer holds the whole model.
        InfeasiblePlan: fewer than N + b peers hold it.
    """
    workers = _pick(
        peers,
        num_required + num_backup,
        need_bytes=need_bytes,
        compute_flops=compute_flops,
        exchange_bytes=exchange_bytes,
        what="sync_backup",
        advice=_ADVICE,
    )
    owners = workers[:num_required] if num_backup > 0 else None
    return ModeLayout(workers=workers, owners=owners, need_bytes=need_bytes)


def ist_layout(
    peers: Sequence[PeerCapacity],
    *,
    num_workers: int,
    need_bytes: int,
    compute_flops: float = 0.0,
    exchange_bytes: float = 0.0,
) -> ModeLayout:
    """The n workers of an ``ist`` job (see the module docstring); `need_bytes` is for n workers.

    Raises:
        WorkerDoesNotFit: no peer holds a worker (the replica plus a 1/n sub-network).
        InfeasiblePlan: fewer than n peers hold one.
    """
    workers = _pick(
        peers,
        num_workers,
        need_bytes=need_bytes,
        compute_flops=compute_flops,
        exchange_bytes=exchange_bytes,
        what="ist",
        advice=_ADVICE,
    )
    return ModeLayout(workers=workers, owners=None, need_bytes=need_bytes)
