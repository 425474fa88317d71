"""IST's blocks as flat index sets, and who holds each entry: the pure part of IST over the network.

Why. Over the network no peer holds the authoritative full model: after a round, every entry of the
model is fresh only at the worker that trained it. `ist.extract_subnetwork` / `ist.write_back` move
whole sub-networks inside one process; here the same deal is expressed per tensor as flat indices
(`subnet_indices`: the entries of the full tensor that worker p's sub-network holds, in the order of
the sub-network tensor's ``flatten()``), and `Holders` records, per entry, the worker whose copy is
current. Each round a worker fetches from every holder only the entries of its next sub-network that
the holder has (the all-to-all of disjoint blocks), so a worker receives about its sub-network's size
per round, never the full model.

Holders, per entry (a worker index of the job, or `EVERYONE`):
- at the start every peer builds the same model from the job seed: `EVERYONE` holds every entry;
- after round r the worker that trained an entry holds it (`Holders.assign`);
- entries nobody trained in round r (the middle matrices' off-diagonal blocks) keep their holder;
- a worker found dead at round r: the entries it held fall back to their holder of the round before
  (who still has the value it gave the dead worker at the start of its last round: its part "keeps the
  previous values"), or to `EVERYONE` (every worker uses its own copy) when that one is dead too
  (`Holders.without`).

Shared tensors (the head bias and the BatchNorm step counters) are trained by every worker and averaged,
as `ist.write_back` does; they are small and travel whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from ravnest_p2p.strategies.ist import IstDeal, _shared_mean, _view

__all__ = ["EVERYONE", "Holders", "ModelTensors", "model_tensors", "shared_mean", "subnet_indices"]

EVERYONE = -1


@dataclasses.dataclass(frozen=True)
class ModelTensors:
    """A `wide_mlp`-shaped model's (or sub-network's) tensors, in a fixed order.

    Attributes:
        dealt: per hidden layer its Linear weight (and bias), its BatchNorm weight, bias, running mean
            and running var; then the head weight. Split by hidden unit.
        shared: the head bias (if any), then every BatchNorm's step counter. Averaged.
    """

    dealt: tuple[Tensor, ...]
    shared: tuple[Tensor, ...]


def model_tensors(layers: Sequence[nn.Module]) -> ModelTensors:
    """The tensors of a `wide_mlp`-shaped model or of a sub-network from `ist.extract_subnetwork`."""
    hidden, head = _view(layers)
    dealt: list[Tensor] = []
    shared: list[Tensor] = [head.bias] if head.bias is not None else []
    for block in hidden:
        dealt.append(block.linear.weight)
        if block.linear.bias is not None:
            dealt.append(block.linear.bias)
        norm = block.norm
        assert norm.running_mean is not None
        assert norm.running_var is not None
        assert norm.num_batches_tracked is not None
        dealt += [norm.weight, norm.bias, norm.running_mean, norm.running_var]
        shared.append(norm.num_batches_tracked)
    dealt.append(head.weight)
    return ModelTensors(dealt=tuple(t.data for t in dealt), shared=tuple(t.data for t in shared))


def subnet_indices(layers: Sequence[nn.Module], deal: IstDeal, position: int) -> list[Tensor]:
    """Flat int64 indices, per `ModelTensors.dealt` tensor, of the entries worker ``position`` trains.

    ``full.flatten()[indices[k]]`` equals ``sub.flatten()`` for the k-th dealt tensor of the sub-network
    `ist.extract_subnetwork(layers, deal, position)` returns (same order), so a sub-network is written
    back with ``full.view(-1)[indices[k]] = sub.flatten()``.
    """
    hidden, head = _view(layers)
    if len(deal.parts) != len(hidden) or not 0 <= position < deal.num_workers:
        raise ValueError(f"the deal does not fit the model (position {position})")
    out: list[Tensor] = []
    prev: Tensor | None = None
    for layer, block in enumerate(hidden):
        rows = deal.parts[layer][position]
        width = block.linear.in_features
        cols = torch.arange(width) if prev is None else prev
        out.append((rows.unsqueeze(1) * width + cols.unsqueeze(0)).reshape(-1))
        if block.linear.bias is not None:
            out.append(rows)
        out += [rows] * 4
        prev = rows
    assert prev is not None
    outputs = torch.arange(head.out_features)
    out.append((outputs.unsqueeze(1) * head.in_features + prev.unsqueeze(0)).reshape(-1))
    return out


def shared_mean(values: Sequence[Tensor]) -> Tensor:
    """The average of a shared tensor over workers, exactly as `ist.write_back` computes it."""
    return _shared_mean(values)


class Holders:
    """Per dealt tensor, per entry: the job's worker index whose copy is current, or `EVERYONE`."""

    def __init__(self, maps: Iterable[Tensor]) -> None:
        self.maps = [m.to(torch.int16) for m in maps]

    @classmethod
    def initial(cls, tensors: ModelTensors) -> Holders:
        """Every peer built the same model: everyone holds everything."""
        return cls(torch.full((t.numel(),), EVERYONE, dtype=torch.int16) for t in tensors.dealt)

    def copy(self) -> Holders:
        return Holders(m.clone() for m in self.maps)

    def assign(self, layers: Sequence[nn.Module], deal: IstDeal, live: Sequence[int]) -> Holders:
        """A copy where worker ``live[p]`` holds the entries it trained in ``deal`` (position p)."""
        out = self.copy()
        for position, worker in enumerate(live):
            for holder_map, index in zip(out.maps, subnet_indices(layers, deal, position), strict=True):
                holder_map[index] = worker
        return out

    def without(self, dead: Iterable[int], history: Sequence[Holders]) -> Holders:
        """A copy where entries held by a dead worker fall back to their newest live holder in ``history``.

        ``history`` lists older holder maps, newest first; an entry with no live holder there falls back
        to `EVERYONE` (every worker uses its own copy).
        """
        dead_set = sorted(set(dead))
        if not dead_set:
            return self
        out = self.copy()
        gone = torch.tensor(dead_set, dtype=torch.int16)
        for k, holder_map in enumerate(out.maps):
            lost = torch.isin(holder_map, gone).nonzero().squeeze(1)
            if lost.numel() == 0:
                continue
            fallback = torch.full((lost.numel(),), EVERYONE, dtype=torch.int16)
            open_ = torch.ones(lost.numel(), dtype=torch.bool)
            for older in history:
                candidate = older.maps[k][lost]
                found = open_ & ~torch.isin(candidate, gone)
                fallback[found] = candidate[found]
                open_ &= ~found
                if not bool(open_.any()):
                    break
            holder_map[lost] = fallback
        return out

    def held_by(self, indices: Sequence[Tensor], worker: int) -> list[Tensor]:
        """Per dealt tensor, the boolean mask over ``indices[k]`` of the entries ``worker`` holds."""
        return [m[index] == worker for m, index in zip(self.maps, indices, strict=True)]
