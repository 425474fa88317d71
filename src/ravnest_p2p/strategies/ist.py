"""Independent Subnetwork Training (IST): deal a wide MLP's hidden units to n workers, copy them back.

Problem. Data parallelism ships the whole model (or its gradient) every step; on volunteer links a wide
MLP's hidden layers dominate that traffic. IST (Yuan, Wolfe, Dun, Tang, Kyrillidis, Jermaine, arXiv
1910.02120, PVLDB 2022) gives each worker a disjoint slice of the hidden units instead: a worker trains
only the weights touching its units for K local steps, and ships back ~(1/n) of the hidden layers once
per round.

Algorithm (one round, this module's part; the training in between is the caller's):
1. `deal_hidden_units`: for every hidden layer, a fresh random permutation seeded by (seed, round) -
   every peer computes the same deal with no message - cut into n near-equal disjoint parts P_l,i.
2. `extract_subnetwork`: worker i's sub-network. Choices, as in the authors' MLP code:
   - first Linear: rows P_1,i, all input columns (inputs are not split);
   - middle Linear l: the diagonal block W_l[P_l,i, P_{l-1},i]; off-diagonal blocks are not trained
     this round (with n workers a worker holds 1/n² of a middle matrix);
   - BatchNorm l: scale, shift, running mean/var at P_l,i (dealt, like the units they normalise);
   - head Linear: columns P_L,i, all outputs (outputs are not split); its bias is shared.
   Output scaling (`ScaleRule`): by default the input of every layer whose inputs are dealt hidden
   units is multiplied by n inside the sub-network at train time (Shulgin & Richtárik's sketch
   C_i = n·Σ e_j e_jᵀ, an unbiased estimate of the full layer's pre-activation), so the written-back
   full model is used as is at test time. `ScaleRule.TEST` instead trains unscaled and multiplies those
   inputs by 1/n at test time (ResIST's 1/S rule; see `ist_local.eval_layers`).
3. `write_back`: dealt slices are copied back (they are disjoint: nothing to average); the shared
   parts (head bias, BatchNorm step counters) are averaged. Round trip without training is bit-exact.

Alternatives rejected. Averaging the dealt parts like local SGD: they are disjoint, so an average would
only mix in stale copies. Redrawing with replacement (dropout-style): units would be trained by several
workers or none, and the write-back would need averaging. Splitting the input/output dimensions: the
paper keeps them whole and so do we.

Known limits. One model family (`wide_mlp`: Linear(no bias) -> BN -> ReLU blocks, Linear head). With
heterogeneous data IST carries an irreducible bias (Shulgin & Richtárik, arXiv 2306.16484; see
`ist_theory`). Running BatchNorm statistics are dealt and written back with their units; under the
TRAIN rule they served the full model better than re-estimated ones in our digits run, under TEST/NONE
they describe unscaled partial sums and `ist_local.recalibrate_batchnorm` should re-estimate them.
Over the network, `ist_blocks` expresses the same deal as flat indices and holder maps, and
`training.ist_runner` runs it (``mode: ist``).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "IstDeal",
    "IstTraffic",
    "ScaleRule",
    "deal_hidden_units",
    "extract_subnetwork",
    "hidden_sizes",
    "ist_bytes_per_worker",
    "subnetwork_bytes",
    "write_back",
]


class ScaleRule(enum.StrEnum):
    """Where IST compensates for a sub-network seeing 1/n of a layer's inputs."""

    TRAIN = "train"  # multiply dealt inputs by n inside sub-networks; full model unchanged at test time
    TEST = "test"  # train unscaled; multiply dealt inputs by 1/n at test time (ResIST's 1/S)
    NONE = "none"  # no compensation (a control for experiments)


@dataclasses.dataclass(frozen=True)
class IstDeal:
    """One round's partition of every hidden layer's units among the workers.

    Attributes:
        round_index: the round it was drawn for.
        num_workers: n.
        parts: ``parts[l][i]`` is the sorted int64 tensor of layer l's units dealt to worker i.
    """

    round_index: int
    num_workers: int
    parts: tuple[tuple[Tensor, ...], ...]


class _Scale(nn.Module):
    """Multiply by a constant (IST's output scaling); no parameters."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = float(factor)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


@dataclasses.dataclass(frozen=True)
class _Hidden:
    linear: nn.Linear
    norm: nn.BatchNorm1d


def _only(module: nn.Module, kind: type[nn.Module], what: str) -> nn.Module:
    found = [m for m in module.modules() if isinstance(m, kind)]
    if len(found) != 1:
        raise ValueError(f"{what}: expected exactly one {kind.__name__}, found {len(found)}")
    return found[0]


def _view(layers: Sequence[nn.Module]) -> tuple[list[_Hidden], nn.Linear]:
    """Find the Linear+BatchNorm of each hidden layer and the head of a `wide_mlp`-shaped model."""
    if len(layers) < 2:
        raise ValueError("IST needs at least one hidden layer and a head")
    hidden: list[_Hidden] = []
    for i, layer in enumerate(layers[:-1]):
        linear = _only(layer, nn.Linear, f"layer {i}")
        norm = _only(layer, nn.BatchNorm1d, f"layer {i}")
        assert isinstance(linear, nn.Linear)
        assert isinstance(norm, nn.BatchNorm1d)
        if norm.num_features != linear.out_features or not norm.affine or not norm.track_running_stats:
            raise ValueError(f"layer {i}: expected an affine, tracking BatchNorm1d over the Linear's outputs")
        if hidden and linear.in_features != hidden[-1].linear.out_features:
            raise ValueError(f"layer {i}: input width does not match the previous layer")
        hidden.append(_Hidden(linear, norm))
    head = _only(layers[-1], nn.Linear, "head")
    assert isinstance(head, nn.Linear)
    if head.in_features != hidden[-1].linear.out_features:
        raise ValueError("head: input width does not match the last hidden layer")
    return hidden, head


def hidden_sizes(layers: Sequence[nn.Module]) -> tuple[int, ...]:
    """Widths of the hidden layers of a `wide_mlp`-shaped model.

    Raises:
        ValueError: if the layers are not shaped like `wide_mlp`.
    """
    hidden, _ = _view(layers)
    return tuple(h.linear.out_features for h in hidden)


def deal_hidden_units(sizes: Sequence[int], num_workers: int, *, round_index: int, seed: int = 0) -> IstDeal:
    """Permute each hidden layer's units afresh and cut them into ``num_workers`` disjoint parts.

    The permutation depends only on (seed, round_index, layer), so every peer computes the same deal.

    Args:
        sizes: widths of the hidden layers (`hidden_sizes`).
        num_workers: n >= 1; every layer needs at least n units.
        round_index: the round (>= 0).
        seed: the job's seed.

    Raises:
        ValueError: bad n, round, or a layer narrower than n.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    if any(size < num_workers for size in sizes):
        raise ValueError(f"every hidden layer needs >= {num_workers} units, got widths {tuple(sizes)}")
    parts = []
    for layer, size in enumerate(sizes):
        rng = np.random.default_rng([seed, round_index, layer])
        chunks = np.array_split(rng.permutation(size), num_workers)
        parts.append(tuple(torch.from_numpy(np.sort(chunk)).to(torch.int64) for chunk in chunks))
    return IstDeal(round_index=round_index, num_workers=num_workers, parts=tuple(parts))


def _check_deal(deal: IstDeal, sizes: tuple[int, ...], worker: int | None = None) -> None:
    if len(deal.parts) != len(sizes):
        raise ValueError(f"deal covers {len(deal.parts)} hidden layers, model has {len(sizes)}")
    for layer, (layer_parts, size) in enumerate(zip(deal.parts, sizes, strict=True)):
        if len(layer_parts) != deal.num_workers:
            raise ValueError(f"layer {layer}: {len(layer_parts)} parts for {deal.num_workers} workers")
        units = torch.cat([p.to(torch.int64) for p in layer_parts]) if layer_parts else torch.empty(0)
        if not torch.equal(torch.sort(units).values, torch.arange(size)):
            raise ValueError(f"layer {layer}: the deal does not partition {size} units")
    if worker is not None and not 0 <= worker < deal.num_workers:
        raise ValueError(f"worker must be in [0, {deal.num_workers}), got {worker}")


def extract_subnetwork(
    layers: Sequence[nn.Module], deal: IstDeal, worker: int, *, scale_rule: ScaleRule = ScaleRule.TRAIN
) -> list[nn.Module]:
    """Build worker ``worker``'s sub-network (a copy: training it leaves ``layers`` untouched).

    Returns:
        Layers shaped like `wide_mlp` (``nn.Sequential(*result)`` is the sub-network), with a scaling
        module before every layer whose inputs are dealt units when ``scale_rule`` is TRAIN.

    Raises:
        ValueError: if ``layers`` is not shaped like `wide_mlp` or the deal does not fit it.
    """
    hidden, head = _view(layers)
    sizes = tuple(h.linear.out_features for h in hidden)
    _check_deal(deal, sizes, worker)
    factor = float(deal.num_workers) if scale_rule is ScaleRule.TRAIN else 1.0
    out: list[nn.Module] = []
    prev: Tensor | None = None
    with torch.no_grad():
        for layer, block in enumerate(hidden):
            rows = deal.parts[layer][worker]
            weight = block.linear.weight[rows] if prev is None else block.linear.weight[rows][:, prev]
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=block.linear.bias is not None)
            linear.weight.copy_(weight)
            if block.linear.bias is not None:
                assert linear.bias is not None
                linear.bias.copy_(block.linear.bias[rows])
            src = block.norm
            norm = nn.BatchNorm1d(len(rows), eps=src.eps, momentum=src.momentum)
            for name in ("weight", "bias", "running_mean", "running_var"):
                getattr(norm, name).copy_(getattr(src, name)[rows])
            assert norm.num_batches_tracked is not None
            assert src.num_batches_tracked is not None
            norm.num_batches_tracked.copy_(src.num_batches_tracked)
            first: list[nn.Module] = [nn.Flatten()] if prev is None else [_Scale(factor)]
            out.append(nn.Sequential(*first, linear, norm, nn.ReLU()))
            prev = rows
        assert prev is not None
        new_head = nn.Linear(len(prev), head.out_features, bias=head.bias is not None)
        new_head.weight.copy_(head.weight[:, prev])
        if head.bias is not None:
            assert new_head.bias is not None
            new_head.bias.copy_(head.bias)
        out.append(nn.Sequential(_Scale(factor), new_head))
    return out


def _shared_mean(values: Sequence[Tensor]) -> Tensor:
    """Mean anchored at the first value: x0 + mean(x_i - x0), so n equal copies give x0 bit for bit."""
    anchor = values[0]
    if anchor.is_floating_point():
        return anchor + torch.stack([v - anchor for v in values]).mean(dim=0)
    return anchor + torch.div(
        torch.stack([v - anchor for v in values]).sum(dim=0), len(values), rounding_mode="floor"
    )


def _check_tensors(
    worker: int, hidden: list[_Hidden], head: nn.Linear, sub_hidden: list[_Hidden], sub_head: nn.Linear
) -> None:
    """Refuse a sub-network with a wrong-dtype or non-finite tensor (widths are checked by the caller)."""
    pairs: list[tuple[nn.Module, nn.Module]] = [(head, sub_head)]
    pairs += [
        (m, s)
        for b, sb in zip(hidden, sub_hidden, strict=True)
        for m, s in ((b.linear, sb.linear), (b.norm, sb.norm))
    ]
    for full_module, sub_module in pairs:
        full_tensors = dict(full_module.named_parameters()) | dict(full_module.named_buffers())
        for name, tensor in (*sub_module.named_parameters(), *sub_module.named_buffers()):
            if name not in full_tensors or tensor.dtype != full_tensors[name].dtype:
                raise ValueError(f"sub-network {worker}: {name} has dtype {tensor.dtype}, not the model's")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"sub-network {worker}: {name} has non-finite values")


def write_back(layers: Sequence[nn.Module], deal: IstDeal, subnets: Sequence[Sequence[nn.Module]]) -> None:
    """Copy every worker's dealt slices into the full model; average the shared parts. In place.

    Everything is checked before anything is written: a bad sub-network changes nothing.

    Raises:
        ValueError: wrong number of sub-networks, or a sub-network whose shapes do not match the deal.
    """
    hidden, head = _view(layers)
    sizes = tuple(h.linear.out_features for h in hidden)
    _check_deal(deal, sizes)
    if len(subnets) != deal.num_workers:
        raise ValueError(f"expected {deal.num_workers} sub-networks, got {len(subnets)}")
    views = []
    for worker, sub in enumerate(subnets):
        sub_hidden, sub_head = _view(sub)
        if len(sub_hidden) != len(hidden):
            raise ValueError(f"sub-network {worker}: {len(sub_hidden)} hidden layers, expected {len(hidden)}")
        expect = [len(deal.parts[layer][worker]) for layer in range(len(hidden))]
        got = [h.linear.out_features for h in sub_hidden]
        if got != expect or sub_head.out_features != head.out_features:
            raise ValueError(f"sub-network {worker}: widths {got} do not match the deal {expect}")
        if sub_hidden[0].linear.in_features != hidden[0].linear.in_features:
            raise ValueError(f"sub-network {worker}: input width does not match the model")
        if (sub_head.bias is None) != (head.bias is None):
            raise ValueError(f"sub-network {worker}: head bias does not match the model")
        for block, sub_block in zip(hidden, sub_hidden, strict=True):
            if (block.linear.bias is None) != (sub_block.linear.bias is None):
                raise ValueError(f"sub-network {worker}: hidden Linear bias does not match the model")
        _check_tensors(worker, hidden, head, sub_hidden, sub_head)
        views.append((sub_hidden, sub_head))
    with torch.no_grad():
        for worker, (sub_hidden, sub_head) in enumerate(views):
            prev: Tensor | None = None
            for layer, (block, sub_block) in enumerate(zip(hidden, sub_hidden, strict=True)):
                rows = deal.parts[layer][worker]
                if prev is None:
                    block.linear.weight[rows] = sub_block.linear.weight
                else:
                    block.linear.weight[rows.unsqueeze(1), prev.unsqueeze(0)] = sub_block.linear.weight
                if block.linear.bias is not None and sub_block.linear.bias is not None:
                    block.linear.bias[rows] = sub_block.linear.bias
                for name in ("weight", "bias", "running_mean", "running_var"):
                    getattr(block.norm, name)[rows] = getattr(sub_block.norm, name)
                prev = rows
            assert prev is not None
            head.weight[:, prev] = sub_head.weight
        for layer, block in enumerate(hidden):
            counters = [sub_hidden[layer].norm.num_batches_tracked for sub_hidden, _ in views]
            assert block.norm.num_batches_tracked is not None
            block.norm.num_batches_tracked.copy_(_shared_mean([c for c in counters if c is not None]))
        if head.bias is not None:
            head.bias.copy_(_shared_mean([h.bias for _, h in views if h.bias is not None]))


def subnetwork_bytes(subnet: Sequence[nn.Module]) -> int:
    """Bytes of a sub-network's parameters and buffers: what a worker receives, and sends back, per round."""
    tensors = [t for layer in subnet for t in (*layer.parameters(), *layer.buffers())]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclasses.dataclass(frozen=True)
class IstTraffic:
    """Per-worker, per-round, one-way traffic of IST for a `wide_mlp` (widths divisible by n).

    Attributes:
        dealt_bytes: first Linear rows, BatchNorm tensors and head columns: 1/n of the full ones.
        block_bytes: diagonal blocks of the middle Linears: 1/n² of each middle matrix.
        shared_bytes: head bias and BatchNorm counters (averaged, sent whole by every worker).
        full_model_bytes: the whole model, for comparison with data parallelism (per step).
    """

    dealt_bytes: int
    block_bytes: int
    shared_bytes: int
    full_model_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.dealt_bytes + self.block_bytes + self.shared_bytes


def ist_bytes_per_worker(
    in_features: int,
    sizes: Sequence[int],
    out_features: int,
    num_workers: int,
    *,
    dtype_bytes: int = 4,
    counter_bytes: int = 8,
) -> IstTraffic:
    """Closed form of `subnetwork_bytes` for a `wide_mlp` whose widths are multiples of ``num_workers``.

    Raises:
        ValueError: if a width is not a multiple of ``num_workers``.
    """
    n = num_workers
    if n < 1 or any(h % n for h in sizes) or not sizes:
        raise ValueError(f"widths {tuple(sizes)} must be non-empty multiples of num_workers={n}")
    dealt_full = in_features * sizes[0] + sum(4 * h for h in sizes) + sizes[-1] * out_features
    middle_full = sum(a * b for a, b in itertools.pairwise(sizes))
    shared = out_features * dtype_bytes + len(sizes) * counter_bytes
    full = (dealt_full + middle_full) * dtype_bytes + shared
    return IstTraffic(
        dealt_bytes=dealt_full // n * dtype_bytes,
        block_bytes=middle_full // (n * n) * dtype_bytes,
        shared_bytes=shared,
        full_model_bytes=full,
    )
