"""Which peers average which parameters: the shard map of multi-ring all-reduce (pure, no I/O).

Problem. Clusters are replicas of one model, but each cuts it into pipeline stages at its own points,
so "the peer holding stage 2" means different parameters in different clusters. Averaging must pair up
the peers that hold the *same* parameters: for each parameter, exactly one owner per cluster.

Solution. Parameters (and floating buffers) are keyed by their global name (``"3.weight"``). Every
name has one owner per cluster, so it has an *owner tuple* (owner in cluster 0, owner in cluster 1,
...). Names with the same owner tuple form a shard: cutting the model's flat parameter space at every
stage boundary of every cluster gives exactly these groups when stages are contiguous, and grouping by
owner tuple stays correct even when they are not (a peer owning two stages of a cluster just gets fewer,
larger shards). The owners of a shard form its ring; the ring order is a hash of (epoch, ring id, peer
id), so it changes with every epoch (no peer is always the first to send) and every peer computes the
same order from the same inputs without talking.

Canonical order. Inside a shard, names are sorted by (layer index, attribute name): global names start
with the layer's index in the whole model, so this is the model's layer order and does not depend on
how any cluster split it (concatenating stages would interleave parameters and buffers differently).

Buffers. Floating buffers (BatchNorm running mean/var) are averaged like parameters. Integer buffers
(``num_batches_tracked``) are left out on purpose: they only count local steps, and averaging a count
has no meaning; each replica keeps its own (`floating_entries` drops them).

Optimizer state (hook). Any extra floating tensor a stage names with its layer prefix (e.g.
``"3.weight/exp_avg"``) can be listed with the stage's entries and handed to the averager with the
parameters; it then lands in that layer's shard. Not done by default: averaging Adam moments costs 2x
the traffic and DaSGD-style delayed averaging works without it.

Alternatives rejected. One global ring over all peers (hivemind's averager groups whole peers) would
make every peer send parameters it does not hold. Hashing parameters to rings ignores who holds them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Shard", "ShardMap", "StageEntries", "build_shard_map", "floating_entries", "layer_order_key"]

StageEntries = tuple[str, Sequence[tuple[str, int]]]
"""(owner peer id, [(global name, numel), ...]) for one stage of one cluster."""


def layer_order_key(name: str) -> tuple[int, int, str]:
    """Sort key of a global name: its layer index first (numerically), then the rest of the name."""
    head, _, rest = name.partition(".")
    if head.isdigit():
        return (0, int(head), rest)
    return (1, 0, name)


def floating_entries(named: Mapping[str, torch.Tensor]) -> list[tuple[str, int]]:
    """The (name, numel) entries of the floating tensors of a stage (integer buffers are not averaged)."""
    return [(name, t.numel()) for name, t in named.items() if t.is_floating_point()]


def _digest(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()


@dataclass(frozen=True)
class Shard:
    """A group of parameters held by the same peer in every cluster.

    Attributes:
        index: position of the shard in the map (by its first name in layer order).
        ring_id: a name for this shard's ring, unique per epoch and shard contents.
        names: parameter names, in canonical (layer) order.
        numels: element count of each name.
        owners: the owner of the shard in each cluster, in cluster order.
        ring: the owners in this epoch's ring order.
    """

    index: int
    ring_id: str
    names: tuple[str, ...]
    numels: tuple[int, ...]
    owners: tuple[str, ...]
    ring: tuple[str, ...]

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclass(frozen=True)
class ShardMap:
    """All shards of one epoch; every peer computes the same map from the same plan."""

    epoch: int
    shards: tuple[Shard, ...]

    def shards_of(self, peer_id: str) -> list[Shard]:
        """The shards `peer_id` owns (one ring each), in shard order."""
        return [s for s in self.shards if peer_id in s.owners]

    def by_ring_id(self, ring_id: str) -> Shard | None:
        return next((s for s in self.shards if s.ring_id == ring_id), None)


def build_shard_map(clusters: Sequence[Sequence[StageEntries]], *, epoch: int) -> ShardMap:
    """Cut the parameter space at every stage boundary of every cluster into shards.

    Args:
        clusters: per cluster, its stages in pipeline order, each as (owner peer id, [(name, numel)]).
            Every cluster must hold the same names with the same sizes, each exactly once.
        epoch: the plan epoch; seeds the ring order.

    Returns:
        The shard map, shards ordered by their first parameter in layer order.

    Raises:
        ValueError: clusters disagree on names or sizes, a name appears twice in a cluster, or one peer
            owns the same shard in two clusters (it would be its own ring neighbour).
    """
    if not clusters:
        raise ValueError("no clusters")
    reference: dict[str, int] | None = None
    owner_of: list[dict[str, str]] = []
    for ci, stages in enumerate(clusters):
        sizes: dict[str, int] = {}
        owners: dict[str, str] = {}
        for peer_id, entries in stages:
            for name, numel in entries:
                if name in sizes:
                    raise ValueError(f"cluster {ci}: {name!r} is held by two stages")
                if numel < 0:
                    raise ValueError(f"cluster {ci}: {name!r} has a negative size")
                sizes[name], owners[name] = int(numel), peer_id
        if reference is None:
            reference = sizes
        elif sizes != reference:
            missing = sorted(set(reference) ^ set(sizes))[:5]
            differ = [n for n in reference if n in sizes and sizes[n] != reference[n]][:5]
            raise ValueError(f"cluster {ci} differs from cluster 0: names {missing}, sizes {differ}")
        owner_of.append(owners)
    assert reference is not None
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in sorted(reference, key=layer_order_key):
        key = tuple(owners[name] for owners in owner_of)
        groups.setdefault(key, []).append(name)
    shards = []
    for index, (owners_tuple, names) in enumerate(groups.items()):
        if len(set(owners_tuple)) != len(owners_tuple):
            raise ValueError(f"a peer owns {names[0]!r} in two clusters: {owners_tuple}")
        ring_id = f"e{epoch}/s{index}/{_digest(*names, *owners_tuple)[:12]}"
        ring = tuple(sorted(owners_tuple, key=functools.partial(_digest, epoch, ring_id)))
        shards.append(
            Shard(
                index=index,
                ring_id=ring_id,
                names=tuple(names),
                numels=tuple(reference[n] for n in names),
                owners=owners_tuple,
                ring=ring,
            )
        )
    return ShardMap(epoch=epoch, shards=tuple(shards))
