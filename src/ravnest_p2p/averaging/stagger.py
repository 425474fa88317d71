"""Staggered syncs (Streaming DiLoCo): fragments of the model sync at different steps.

Problem. An outer sync every H steps moves every shard's Δ at once: the link idles for H steps, then
carries the whole model in a burst, and a sync's peak bandwidth is the model's size. Streaming DiLoCo
(Douillard et al., arXiv 2501.18512) splits the model into F fragments that sync at staggered times,
each still every H steps, so at any moment at most one fragment is on the wire (peak / F) and each
sync overlaps the next inner steps (applied when it arrives: delayed averaging, `overlap.py`).

Here a fragment is a set of the shard map's rings (shards are already the natural units: each is
averaged by its own ring among its owners). `fragment_rings` balances them by size: largest shard
first, into the lightest fragment so far (ties: lowest fragment), shards in map order; every peer
computes the same assignment from the same map. `due_fragment` says, for a finished step, which
fragment syncs and under which round index: with s = max(1, H // F) steps between syncs, step t with
t % s == 0 starts round t // s of fragment (t // s) % F. Every fragment thus syncs every F x s steps
(H when F divides H), and round indices are distinct and the same on every replica.

Limits. A shard bigger than the model / F keeps its fragment heavier (a shard is not split); a peer
that owns no shard of the due fragment has nothing to do that step. Fragments apply to syncs by step
(`averaging_period_steps`); wall-clock syncs (`averaging_period_s`) sync every shard at once.
"""

from __future__ import annotations

from ravnest_p2p.averaging.shards import ShardMap

__all__ = ["due_fragment", "fragment_rings"]


def fragment_rings(shard_map: ShardMap, num_fragments: int) -> list[frozenset[str]]:
    """The ring ids of each of `num_fragments` fragments, balanced by elements (some may be empty).

    Raises:
        ValueError: `num_fragments` < 1.
    """
    if num_fragments < 1:
        raise ValueError("num_fragments must be at least 1")
    loads = [0] * num_fragments
    rings: list[set[str]] = [set() for _ in range(num_fragments)]
    for shard in sorted(shard_map.shards, key=lambda s: (-s.numel, s.index)):
        lightest = min(range(num_fragments), key=lambda f: (loads[f], f))
        loads[lightest] += shard.numel
        rings[lightest].add(shard.ring_id)
    return [frozenset(r) for r in rings]


def due_fragment(step: int, period_steps: int, num_fragments: int) -> tuple[int, int] | None:
    """(round index, fragment) of the sync that finished step `step` starts, or None.

    Raises:
        ValueError: a period or fragment count below 1.
    """
    if period_steps < 1 or num_fragments < 1:
        raise ValueError("period_steps and num_fragments must be at least 1")
    spacing = max(1, period_steps // num_fragments)
    if step <= 0 or step % spacing:
        return None
    round_index = step // spacing
    return round_index, round_index % num_fragments
