"""Where a new owner of a layer range gets its state from when the plan moves, and how it assembles it.

A new plan moves state, never resets it. For every layer of its new range, a stage asks, in order:
(1) itself, if this process held those layers on the previous plan (the whole stage state, optimizer
included, when the range is unchanged); (2) the previous plan's owner of the layer in the same cluster,
if alive; (3) the owners of the layer in the previous plan's other clusters (replicas, averaged with it);
(4) the newest checkpoint step complete across the whole model (`CheckpointQuery`): this peer's own
file if it has that piece, else fetched from a member of the plan that announced it. Only members of
the previous (and, for checkpoints, the current) plan are ever asked (the allow-list), so a stranger
cannot feed a stage weights. When no source answers, the layers start from the initial weights
(logged as a warning: the job then loses what those layers learned).

`state_sources` is pure (unit-tested); `gather_state` runs the calls through a `StateSource`, the seam
the hand-over client and the checkpoint reader plug into (`state_source.py`, wired by `node.py`).
`apply_state` restores what was gathered into a new stage; `cluster_batches` resumes the data.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.data import ArrayDataset, iterate_batches, num_batches
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.role import Assignment, StageRole
from ravnest_p2p.training.stage_state import (
    StageState,
    StateMismatch,
    merge_states,
    names_in_layers,
    restore_state,
)

__all__ = [
    "CheckpointQuery",
    "HeldState",
    "Segment",
    "StateSource",
    "freshest_first",
    "gather_state",
    "state_sources",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldState:
    """A stage's state as this process holds it between plans: its layers and `StageState` (by name)."""

    first_layer: int
    end_layer: int
    state: StageState


@dataclass(frozen=True)
class CheckpointQuery:
    """What a stage asks of the job's checkpoints when no live peer holds some of its layers.

    Attributes:
        job: the job (its digest, placement excluded, ties a checkpoint to it).
        num_layers: layers of the whole model: a step counts only when its checkpoints cover all of them
            (every stage resumes from the same step).
        members: peers whose checkpoints may be used (the current and previous plans' members); any
            other peer's announcement is ignored.
    """

    job: JobSpec
    num_layers: int
    members: frozenset[str]

    @classmethod
    def of(cls, job: JobSpec, role: StageRole, allowed: frozenset[str]) -> CheckpointQuery:
        """The query of `role` on its plan; `allowed`: the previous plan's members."""
        layers = max(cluster[-1].end_layer for cluster in role.assignment)
        return cls(job=job, num_layers=layers, members=role.plan_peers | allowed)


@dataclass(frozen=True)
class Segment:
    """Layers [first_layer, end_layer) of the new role and the peers to ask for them, best first."""

    first_layer: int
    end_layer: int
    candidates: tuple[str, ...]


class StateSource(Protocol):
    """Fetches stage state by global name; implementations check digests and sizes before returning."""

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
        """State of layers [first_layer, end_layer) that `peer_id` held on plan `epoch` (None: none;
        `epoch` None: the newest plan on which it serves some of those layers).

        `allowed` is the previous plan's membership; an implementation refuses any other peer.
        """
        ...

    async def from_checkpoint(
        self, query: CheckpointQuery, *, first_layer: int, end_layer: int
    ) -> StageState | None:
        """State of those layers from the job's newest checkpoint step complete across the whole model
        (None: no checkpoint covers them)."""
        ...

    async def share_checkpoints(self, job_id: str, peer_ids: frozenset[str]) -> None:
        """Let `peer_ids` fetch this peer's checkpoints of the job (before any stage of it runs here)."""
        ...

    async def announce_checkpoints(self, job: JobSpec) -> None:
        """Announce every checkpoint of `job` this peer's disk holds (before the peer plans it)."""
        ...


def _owner(cluster: Sequence[Any], layer: int) -> str | None:
    for stage in cluster:
        if stage.first_layer <= layer < stage.end_layer:
            return str(stage.peer_id)
    return None


def state_sources(
    previous: Assignment,
    role: StageRole,
    *,
    alive: Collection[str],
    cluster_order: Sequence[int] | None = None,
) -> list[Segment]:
    """For every layer of `role`, the previous plan's holders to ask, grouped into segments.

    Args:
        previous: the previous plan's clusters (the only peers ever asked).
        role: the new role.
        alive: peers believed alive now (this peer counts as alive).
        cluster_order: the previous plan's clusters, freshest state first (e.g. by how far each got:
            a cluster whose pipeline broke stopped early). Every layer then comes from the first
            cluster in this order whose holder is alive, so a stage is not stitched from replicas at
            different points. None: the same cluster index as the role's first, then the others by
            index (this peer's own copy is not preferred: one consistent replica matters more than a
            saved transfer).

    Returns:
        Segments covering [role.first_layer, role.end_layer) in order.
    """
    segments: list[Segment] = []
    live = set(alive) | {role.peer_id}
    if cluster_order is None:
        order = list(range(len(previous)))
        if role.cluster_index < len(previous):
            order.remove(role.cluster_index)
            order.insert(0, role.cluster_index)
    else:
        order = [c for c in cluster_order if 0 <= c < len(previous)]
    for layer in range(role.first_layer, role.end_layer):
        candidates: list[str] = []
        for c in order:
            owner = _owner(previous[c], layer)
            if owner is not None and owner in live and owner not in candidates:
                candidates.append(owner)
        if segments and segments[-1].candidates == tuple(candidates):
            last = segments[-1]
            segments[-1] = Segment(last.first_layer, layer + 1, last.candidates)
        else:
            segments.append(Segment(layer, layer + 1, tuple(candidates)))
    return segments


def freshest_first(
    positions: Mapping[tuple[int, int], int],
    *,
    epoch: int,
    num_clusters: int,
    prefer: int,
    tie_micro_batches: int = 0,
) -> list[int] | None:
    """Cluster indices of plan `epoch`, furthest data position first (ties: `prefer`, then by index).

    With `tie_micro_batches` > 0, every cluster within that many micro-batches of the furthest counts
    as tied with it and these come first by index alone: healthy replicas race each other, and peers
    that read their positions a moment apart must still agree on one source (with `prefer`, the stages
    of one new cluster were seen to take their layers from different replicas).

    None unless every cluster of that plan has a position (then `state_sources` uses its default): a
    peer keeps one progress record, so a first stage that already runs the next plan no longer shows
    how far its old cluster got (seen on loopback: the furthest cluster's record was gone, the stalled
    one ranked first and a stage resumed from it).
    """
    known = {c: positions[(epoch, c)] for c in range(num_clusters) if (epoch, c) in positions}
    if len(known) < num_clusters:
        return None
    if tie_micro_batches > 0:
        furthest = max(known.values())
        ahead = [c for c in range(num_clusters) if known[c] >= furthest - tie_micro_batches]
        behind = sorted((c for c in range(num_clusters) if c not in ahead), key=lambda c: (-known[c], c))
        return ahead + behind
    return sorted(range(num_clusters), key=lambda c: (-known.get(c, -1), c != prefer, c))


async def gather_state(
    role: StageRole,
    segments: Sequence[Segment],
    *,
    held: HeldState | None,
    source: StateSource | None,
    allowed: frozenset[str],
    previous_epoch: int,
    checkpoints: CheckpointQuery | None = None,
) -> tuple[StageState | None, dict[str, str]]:
    """Assemble the new role's starting state; returns (state or None, {layer span: where it came from}).

    Layers no live holder answers for come from `checkpoints` (None: no checkpoint is asked).

    A role whose range equals what this peer held gets that state whole (optimizer and counters
    included). Otherwise every segment's tensors are merged by global name (the counters are those of
    the first source that has them).
    """
    if (
        held is not None
        and (held.first_layer, held.end_layer) == (role.first_layer, role.end_layer)
        and len(segments) == 1
        and segments[0].candidates[:1] == (role.peer_id,)
    ):
        return held.state, {f"{role.first_layer}-{role.end_layer}": "self (full)"}
    parts: list[StageState] = []
    origin: dict[str, str] = {}
    for segment in segments:
        span = f"{segment.first_layer}-{segment.end_layer}"
        # an answer without tensors: the peer holds none of these layers (it held others on that plan),
        # or the layers have no parameters; kept only if nobody (no checkpoint either) has tensors for
        # them. Taken as a source, it left a joiner's layers at the initial weights (held-out loss 1.91)
        empty: tuple[str, StageState] | None = None
        answered: list[str] = []  # peers that answered (a failed fetch is not asked again below)
        for peer_id in segment.candidates:
            part: StageState | None = None
            if peer_id == role.peer_id:
                part = _slice(held.state if held is not None else None, segment)
            elif source is not None and peer_id in allowed:
                try:
                    part = await _fetch(source, role, segment, peer_id, previous_epoch, allowed)
                    answered.append(peer_id)
                except Exception as exc:  # a peer's failure costs that source, never the stage
                    logger.info("state of layers %s from %s failed: %r", span, peer_id, exc)
            if part is not None and not part.tensors:
                empty = empty or (peer_id, part)
                continue
            if part is not None:
                parts.append(part)
                origin[span] = peer_id
                break
        else:
            # nobody answered for the previous plan (a split vote leaves a plan some holders never ran):
            # the newest state the same holders serve of these layers, before an older checkpoint (a lab
            # kill restarted layers from the initial weights while their holder still trained them)
            newest = await _newest_from(role, segment, answered, source=source, allowed=allowed)
            if newest is not None:
                parts.append(newest[1])
                origin[span] = f"{newest[0]} (newest)"
                continue
            found = None
            if source is not None and checkpoints is not None:
                try:
                    found = await source.from_checkpoint(
                        checkpoints, first_layer=segment.first_layer, end_layer=segment.end_layer
                    )
                except Exception as exc:
                    logger.info("checkpoint of layers %s failed: %r", span, exc)
            part = _slice(found, segment)
            if part is not None and (part.tensors or empty is None):
                parts.append(part)
                origin[span] = "checkpoint"
                continue
            if empty is not None:  # nobody has tensors of these layers: they have none
                parts.append(empty[1])
                origin[span] = empty[0]
                continue
            origin[span] = "initial weights"
            logger.warning("job %s: no state for layers %s; initial weights there", role.job_id, span)
    if not parts:
        return None, origin
    meta = next((p.meta for p in parts if p.meta is not None), None)
    try:
        return merge_states(parts, meta=meta), origin
    except StateMismatch as exc:  # two sources disagree on a shared name: trust none of them
        logger.warning("job %s: sources disagree (%s); initial weights", role.job_id, exc)
        return None, {span: "initial weights" for span in origin}


async def _fetch(
    source: StateSource,
    role: StageRole,
    segment: Segment,
    peer_id: str,
    epoch: int | None,
    allowed: frozenset[str],
) -> StageState | None:
    """`peer_id`'s state of the segment's layers on plan `epoch` (None: its newest), sliced to them."""
    found = await source.fetch(
        peer_id,
        job_id=role.job_id,
        epoch=epoch,
        first_layer=segment.first_layer,
        end_layer=segment.end_layer,
        allowed=allowed,
    )
    return _slice(found, segment)


async def _newest_from(
    role: StageRole,
    segment: Segment,
    peers: Sequence[str],
    *,
    source: StateSource | None,
    allowed: frozenset[str],
) -> tuple[str, StageState] | None:
    """(peer, its newest state of the segment's layers, on any plan) from the first of `peers` that has
    tensors of them; None if none does."""
    if source is None:
        return None
    for peer_id in peers:
        try:
            part = await _fetch(source, role, segment, peer_id, None, allowed)
        except Exception as exc:
            span = f"{segment.first_layer}-{segment.end_layer}"
            logger.info("newest state of layers %s from %s failed: %r", span, peer_id, exc)
            continue
        if part is not None and part.tensors:
            return peer_id, part
    return None


def _slice(state: StageState | None, segment: Segment) -> StageState | None:
    """The part of `state` in the segment's layers (a source is asked only for layers it held)."""
    if state is None:
        return None
    try:
        return state.subset(names_in_layers(state.tensors, segment.first_layer, segment.end_layer))
    except StateMismatch:  # a name that is not a global state name: nothing from this source
        return None


def apply_state(executor: StageExecutor, state: StageState) -> str:
    """Resume `executor` from `state` (global names); returns what was restored: full, partial or none.

    A state covering the whole stage restores everything it carries (parameters, buffers, optimizer
    state, counters and LR schedule: `stage_state.restore_state`). A partial one (some layers had no
    source) restores what it has, the rest keeps the initial weights; a state that does not fit at all
    changes nothing.
    """
    try:
        restore_state(executor, state, complete=True)
        return "full"
    except StateMismatch as exc:
        logger.info("stage state is not complete (%s): restoring what there is", exc)
    try:
        restore_state(executor, state, complete=False)
        return "partial"
    except StateMismatch as exc:
        logger.warning("stage state does not fit this stage: %s", exc)
        return "none"


def cluster_batches(
    job: JobSpec,
    dataset: ArrayDataset,
    *,
    cluster_index: int,
    num_clusters: int,
    start: int,
    stop: int | None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """The cluster's micro-batches from job position `start` up to `stop` (None: forever; epochs wrap).

    Position p is batch ``p % per_epoch`` of data epoch ``p // per_epoch`` of the cluster's shard and
    shuffle; from 0 to the job's final step it yields what `stages.train_batches` yields.
    """
    per_epoch = num_batches(len(dataset), batch_size=job.batch_size, num_shards=num_clusters)
    if per_epoch < 1:
        raise ValueError(f"{len(dataset)} samples cannot feed {num_clusters} clusters")
    position = start
    while stop is None or position < stop:
        epoch, index = divmod(position, per_epoch)
        batches = iterate_batches(
            dataset,
            batch_size=job.batch_size,
            seed=job.seed,
            epoch=epoch,
            shard_index=cluster_index,
            num_shards=num_clusters,
        )
        for i, batch in enumerate(batches):
            if i >= per_epoch or (stop is not None and position >= stop):
                break
            if i < index:
                continue
            position += 1
            yield batch
