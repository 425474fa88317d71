"""One parameter shard's owner for synchronous SGD with backup workers, and the workers' batches.

`ShardOwner` wraps the network-free counting of `strategies.backup_workers` (`SyncAggregator`: the first
N gradients tagged with the current step, nothing stale, duplicates dropped) with the job's optimizer
(`runtime.optim`: SGD, momentum, Adam, and the LR schedule indexed by the step) and an asyncio wait, so
the RPC handler can hold a worker's reply until the step completes. ``aggregation="async"`` is the
apply-on-arrival baseline (`AsyncShardOwner`'s rule): every well-formed gradient is applied at once and
its staleness counted.

`SyncBatches` gives any worker its batch for any step (`strategies.sync_layout.batch_slot`): full batches
only, so with b = 0 the mean of the N workers' mean gradients is exactly the large batch's mean gradient.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ravnest_p2p.runtime.optim import OptimizerConfig, build_optimizer, lr_factor
from ravnest_p2p.strategies import GradientRejected, Submission, SyncAggregator, Verdict
from ravnest_p2p.strategies.sync_layout import batch_slot
from ravnest_p2p.training.data import ArrayDataset, shard_indices

__all__ = ["ShardOwner", "SyncBatches", "sync_final_step"]


class ShardOwner:
    """Aggregates and applies one shard's gradients (see module docstring).

    Args:
        params: the shard's parameters at `start_step` (copied).
        workers: the N + b workers allowed to submit.
        num_required: N.
        optimizer: the job's optimizer config (its schedule is indexed by the step).
        start_step: the step the parameters are at (a new owner after a failover starts where its copy is).
        final_step: the job's last step: the shard stops there.
        aggregation: ``sync`` or ``async`` (the baseline).
    """

    def __init__(
        self,
        params: Mapping[str, Tensor],
        workers: Sequence[str],
        num_required: int,
        optimizer: OptimizerConfig,
        *,
        start_step: int,
        final_step: int,
        aggregation: str = "sync",
    ) -> None:
        self.params = {name: torch.nn.Parameter(t.detach().clone()) for name, t in params.items()}
        self.specs = {name: (tuple(p.shape), p.dtype) for name, p in self.params.items()}
        self.config = optimizer
        self.optimizer, _ = build_optimizer(self.params.values(), optimizer)  # the LR is set per step
        self.final_step = final_step
        self.aggregation = aggregation
        self.aggregator = SyncAggregator(
            workers, num_required if aggregation == "sync" else 1, self.specs, start_step=start_step
        )
        self._version = start_step  # async: gradients applied
        self.staleness: collections.Counter[int] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.contributors: list[tuple[str, ...]] = []  # per completed step (tests, metrics)
        self._moved = asyncio.Event()

    @property
    def step(self) -> int:
        return self.aggregator.step if self.aggregation == "sync" else self._version

    @property
    def final(self) -> bool:
        return self.step >= self.final_step

    @property
    def num_pending(self) -> int:
        return self.aggregator.num_pending if self.aggregation == "sync" else 0

    def snapshot(self) -> tuple[int, dict[str, Tensor]]:
        """(step, copies of the parameters at it)."""
        return self.step, {name: p.detach().clone() for name, p in self.params.items()}

    def submit(self, worker_id: str, step: int, grads: Mapping[str, Tensor]) -> Submission:
        """Count (sync) or apply (async) one worker's gradient of `step`.

        Raises:
            GradientRejected: malformed; nothing changes.
        """
        if self.final:
            self.dropped[Verdict.LATE] += 1
            return Submission(Verdict.LATE)
        if self.aggregation == "async":
            return self._apply_now(worker_id, step, grads)
        result = self.aggregator.submit(worker_id, step, grads)
        if result.update is not None:
            self._apply(result.update.step, result.update.mean_grads)
            self.contributors.append(result.update.contributors)
        elif result.verdict != Verdict.ACCEPTED:
            self.dropped[result.verdict] += 1
        return result

    def fast_forward(self, step: int) -> bool:
        """Label the parameters as at `step` (later than now; sync aggregation only) and wake the waiters.

        The update(s) in between are lost for this shard (a dead owner applied them and answered only
        some workers; see docs/training-modes.md). Returns whether the step moved.
        """
        if self.aggregation != "sync" or step > self.final_step or not self.aggregator.fast_forward(step):
            return False
        self._moved.set()
        self._moved = asyncio.Event()
        return True

    def _apply_now(self, worker_id: str, step: int, grads: Mapping[str, Tensor]) -> Submission:
        # the aggregator checks the form only: its step is not the version here
        self.aggregator.check(worker_id, step, grads)
        if step > self._version:
            raise GradientRejected(
                f"worker {worker_id!r}: version {step} is ahead of the shard's {self._version}"
            )
        self.staleness[self._version - step] += 1
        self._apply(self._version, grads)
        self._version += 1
        return Submission(Verdict.APPLIED)

    def _apply(self, step: int, grads: Mapping[str, Tensor]) -> None:
        lr = self.config.lr * lr_factor(step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for name, param in self.params.items():
            param.grad = grads[name].detach().clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._moved.set()
        self._moved = asyncio.Event()

    async def wait_for(self, step: int, timeout_s: float) -> bool:
        """Wait until the shard reaches `step` (or its final step), at most `timeout_s`; whether it did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.step < step and not self.final:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), remaining)
        return True


def sync_final_step(
    num_samples: int, *, batch_size: int, num_workers: int, num_epochs: int, max_steps: int | None
) -> int:
    """Steps of a sync_backup job: every step consumes N + b batch slots of full batches."""
    per_epoch = max(1, num_samples // batch_size)
    steps = max(1, num_epochs * per_epoch // num_workers)
    return min(steps, max_steps) if max_steps is not None else steps


class SyncBatches:
    """Worker `worker_index`'s batch at any step: slot step·W + w of a seeded shuffle per data epoch."""

    def __init__(self, dataset: ArrayDataset, *, batch_size: int, seed: int, num_workers: int) -> None:
        if len(dataset) < batch_size:
            raise ValueError(f"{len(dataset)} samples do not fill one batch of {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.per_epoch = len(dataset) // batch_size
        self._orders: dict[int, Tensor] = {}

    def batch(self, step: int, worker_index: int) -> tuple[Tensor, Tensor]:
        epoch, index = batch_slot(step, worker_index, self.num_workers, self.per_epoch)
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = shard_indices(len(self.dataset), seed=self.seed, epoch=epoch)
            for old in [e for e in self._orders if e < epoch - 1]:
                del self._orders[old]
        picked = order[index * self.batch_size : (index + 1) * self.batch_size]
        return self.dataset.inputs[picked], self.dataset.labels[picked]
