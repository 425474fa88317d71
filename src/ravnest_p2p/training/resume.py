"""Where a new owner of a layer range gets its state from when the plan moves, and how it assembles it.

A new plan moves state, never resets it. For every layer of its new range, a stage asks, in order:
(1) itself, if this process held those layers on the previous plan (the whole stage state, optimizer
included, when the range is unchanged); (2) the previous plan's owner of the layer in the same cluster,
if alive; (3) the owners of the layer in the previous plan's other clusters (replicas, averaged with it);
(4) the newest checkpoint. Only members of the previous plan are ever asked (the allow-list), so a
stranger cannot feed a stage weights. When no source answers, the layers start from the initial weights
(logged as a warning: the job then loses what those layers learned).

`state_sources` is pure (unit-tested); `gather_state` runs the calls through a `StateSource`, the seam
the checkpoint helper's `fetch_state` client and checkpoint reader plug into (`node.py` wires it).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ravnest_p2p.training.role import Assignment, StageRole

__all__ = ["HeldState", "Segment", "StateSource", "gather_state", "state_sources"]

logger = logging.getLogger(__name__)

# A stage's state as a process holds it between plans: `StageExecutor.state_dict()` plus its layer range
# ({"first_layer", "end_layer", "tensors", "optimizer", "scheduler", "num_steps", ...}); a state fetched
# from elsewhere may carry only "tensors" (by global name).
HeldState = dict[str, Any]


@dataclass(frozen=True)
class Segment:
    """Layers [first_layer, end_layer) of the new role and the peers to ask for them, best first."""

    first_layer: int
    end_layer: int
    candidates: tuple[str, ...]


class StateSource(Protocol):
    """Fetches stage state by global name; implementations check digests and sizes before returning."""

    async def fetch(
        self, peer_id: str, *, job_id: str, first_layer: int, end_layer: int, allowed: frozenset[str]
    ) -> HeldState | None:
        """State of layers [first_layer, end_layer) held by `peer_id` (None: it has none / failed).

        `allowed` is the previous plan's membership; an implementation refuses any other peer.
        """
        ...

    async def from_checkpoint(self, *, job_id: str, first_layer: int, end_layer: int) -> HeldState | None:
        """State of those layers from the job's newest checkpoint (None: no checkpoint covers them)."""
        ...


def _owner(cluster: Sequence[Any], layer: int) -> str | None:
    for stage in cluster:
        if stage.first_layer <= layer < stage.end_layer:
            return str(stage.peer_id)
    return None


def state_sources(previous: Assignment, role: StageRole, *, alive: Collection[str]) -> list[Segment]:
    """For every layer of `role`, the previous plan's holders to ask, grouped into segments.

    Args:
        previous: the previous plan's clusters (the only peers ever asked).
        role: the new role.
        alive: peers believed alive now (this peer counts as alive).

    Returns:
        Segments covering [role.first_layer, role.end_layer) in order; each lists the previous owner in
        the same cluster index first, then the owners in the other clusters (lowest index first).
    """
    segments: list[Segment] = []
    live = set(alive) | {role.peer_id}
    for layer in range(role.first_layer, role.end_layer):
        order = list(range(len(previous)))
        if role.cluster_index < len(previous):
            order.remove(role.cluster_index)
            order.insert(0, role.cluster_index)
        candidates: list[str] = []
        for c in order:
            owner = _owner(previous[c], layer)
            if owner is not None and owner in live and owner not in candidates:
                candidates.append(owner)
        if role.peer_id in candidates:  # our own copy first: no network, and it is what we trained
            candidates.remove(role.peer_id)
            candidates.insert(0, role.peer_id)
        if segments and segments[-1].candidates == tuple(candidates):
            last = segments[-1]
            segments[-1] = Segment(last.first_layer, layer + 1, last.candidates)
        else:
            segments.append(Segment(layer, layer + 1, tuple(candidates)))
    return segments


def _layer_of(name: str) -> int:
    return int(name.partition(".")[0])


async def gather_state(
    role: StageRole,
    segments: Sequence[Segment],
    *,
    held: HeldState | None,
    source: StateSource | None,
    allowed: frozenset[str],
) -> tuple[HeldState | None, dict[str, str]]:
    """Assemble the new role's starting state; returns (state or None, {segment: where it came from}).

    A single segment answered by this peer's own held state of the same range returns that state
    whole (optimizer included). Otherwise the tensors of every segment are merged by global name.
    """
    if (
        held is not None
        and (held.get("first_layer"), held.get("end_layer")) == (role.first_layer, role.end_layer)
        and len(segments) == 1
        and segments[0].candidates[:1] == (role.peer_id,)
    ):
        return held, {f"{role.first_layer}-{role.end_layer}": "self (full)"}
    tensors: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for segment in segments:
        span = f"{segment.first_layer}-{segment.end_layer}"
        found: HeldState | None = None
        for peer_id in segment.candidates:
            if peer_id == role.peer_id:
                found = held
            elif source is not None and peer_id in allowed:
                try:
                    found = await source.fetch(
                        peer_id,
                        job_id=role.job_id,
                        first_layer=segment.first_layer,
                        end_layer=segment.end_layer,
                        allowed=allowed,
                    )
                except Exception as exc:  # a peer's failure costs that source, never the stage
                    logger.info("state of layers %s from %s failed: %r", span, peer_id, exc)
                    found = None
            part = _slice(found, segment)
            if part:
                tensors.update(part)
                origin[span] = peer_id
                break
        else:
            if source is not None:
                try:
                    found = await source.from_checkpoint(
                        job_id=role.job_id, first_layer=segment.first_layer, end_layer=segment.end_layer
                    )
                except Exception as exc:
                    logger.info("checkpoint of layers %s failed: %r", span, exc)
                    found = None
                part = _slice(found, segment)
                if part:
                    tensors.update(part)
                    origin[span] = "checkpoint"
                    continue
            origin[span] = "initial weights"
            logger.warning(
                "job %s: no state for layers %s; they start from the initial weights", role.job_id, span
            )
    if not tensors:
        return None, origin
    return {"tensors": tensors}, origin


def _slice(state: HeldState | None, segment: Segment) -> dict[str, Any]:
    if not state:
        return {}
    tensors = state.get("tensors") or {}
    return {n: t for n, t in tensors.items() if segment.first_layer <= _layer_of(n) < segment.end_layer}
