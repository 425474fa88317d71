"""IST in one process: n simulated workers, for experiments and as the reference a networked IST must match.

Why. It runs the same round as the networked IST (`training.ist_runner`) - deal, K local SGD steps per
worker on its own batches, write-back - with the workers as plain objects, so the algorithm's accuracy
can be measured without a network, and it is the bit-exact reference the networked IST is tested
against (tests/unit/training/test_ist_network.py).

Also here: the two test-time helpers IST needs. `eval_layers` applies ResIST's 1/S rule when the
sub-networks were trained unscaled (`ScaleRule.TEST`). `recalibrate_batchnorm` re-estimates BatchNorm
running statistics on the full model: under TEST/NONE those written back from sub-networks describe
unscaled partial sums. Under the default TRAIN rule it did not help in our digits run
(benchmarks/results/ist_inprocess.md): the weights were fitted to the sub-networks' statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from ravnest_p2p.strategies.ist import (
    ScaleRule,
    _Scale,
    deal_hidden_units,
    extract_subnetwork,
    hidden_sizes,
    write_back,
)

__all__ = ["eval_layers", "recalibrate_batchnorm", "train_ist_round"]

Batch = tuple[Tensor, Tensor]


def eval_layers(layers: Sequence[nn.Module], num_workers: int, scale_rule: ScaleRule) -> list[nn.Module]:
    """The full model as it must be evaluated after IST trained it under ``scale_rule``.

    For TRAIN and NONE the layers are returned as they are; for TEST every layer whose inputs are dealt
    hidden units gets a 1/n scaling in front (the modules are shared, not copied).
    """
    if scale_rule is not ScaleRule.TEST:
        return list(layers)
    return [layers[0], *(nn.Sequential(_Scale(1.0 / num_workers), layer) for layer in layers[1:])]


def recalibrate_batchnorm(model: nn.Module, batches: Iterable[Tensor]) -> None:
    """Re-estimate every BatchNorm's running mean/var on ``batches`` (cumulative average), in place.

    The model's training flag and the norms' momenta are restored; parameters are untouched.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    was_training = model.training
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    try:
        with torch.no_grad():
            for x in batches:
                model(x)
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        model.train(was_training)


def train_ist_round(
    layers: Sequence[nn.Module],
    worker_batches: Sequence[Iterable[Batch]],
    *,
    round_index: int,
    seed: int,
    lr: float,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    scale_rule: ScaleRule = ScaleRule.TRAIN,
) -> list[float]:
    """One IST round in process: deal, local SGD on each worker's batches, write back. In place.

    Args:
        layers: the full `wide_mlp`-shaped model.
        worker_batches: one iterable of (x, y) batches per worker (its K local steps).
        round_index: the round (seeds the deal).
        seed: the job's seed.
        lr: plain SGD step size of the local steps (fresh optimizer state each round, as in IST).
        loss_fn: loss(output, labels).
        scale_rule: see `ScaleRule`.

    Returns:
        The mean training loss of each worker's local steps (NaN for a worker without batches).
    """
    num_workers = len(worker_batches)
    deal = deal_hidden_units(hidden_sizes(layers), num_workers, round_index=round_index, seed=seed)
    subnets, losses = [], []
    for worker, batches in enumerate(worker_batches):
        sub = extract_subnetwork(layers, deal, worker, scale_rule=scale_rule)
        model = nn.Sequential(*sub).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        seen = []
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            seen.append(float(loss.detach()))
        subnets.append(sub)
        losses.append(sum(seen) / len(seen) if seen else float("nan"))
    write_back(layers, deal, subnets)
    return losses
