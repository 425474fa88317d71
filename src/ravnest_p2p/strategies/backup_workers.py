"""Synchronous SGD with backup workers: a parameter-shard owner's aggregation logic, network-free.

Problem. Synchronous data parallelism waits for the slowest worker every step; on volunteer machines
one straggler sets the pace. Asynchronous SGD (apply each gradient as it arrives) does not wait, but
applies gradients computed on parameters that are several steps old, which costs accuracy.

Source. Chen, Pan, Monga, Bengio, Jozefowicz, "Revisiting Distributed Synchronous SGD" (arXiv
1604.00981), as in TensorFlow's ``SyncReplicasOptimizer(replicas_to_aggregate=N,
total_num_replicas=N+b)``: launch N + b workers; each reads the parameters at step t and sends back a
gradient tagged with t; the owner sums the first N gradients tagged t, applies their mean once,
advances to t + 1 and clears the accumulator. The <= b gradients of step t still in flight arrive
tagged t < current step and are dropped, as is anything tagged with a future step: nothing stale is
ever applied, and the step time is the N-th order statistic of N + b finishing times. With b = 0 this
is exactly large-batch SGD over the N workers' batches.

Here. `SyncBackupOwner` holds one shard's parameters and applies plain SGD with the averaged gradient
(`SyncAggregator` alone produces the averaged update, for an owner that broadcasts it instead).
`AsyncShardOwner` is the apply-on-arrival baseline (Downpour-style) in the same code, with a staleness
histogram (staleness = owner's version at arrival - version the gradient was computed on).
Every submission is checked before it touches state: an unknown sender, a non-integer step, a missing
or extra tensor, a wrong shape or dtype, or a non-finite value raises `GradientRejected` and changes
nothing; a late, future or duplicate gradient is a normal event and is reported, not raised.

Alternatives rejected. Taking the first N gradients of *any* step (bounded staleness): reintroduces
staleness, the thing the method exists to remove. Waiting on a deadline instead of a count: the step
would depend on wall-clock tuning; the count adapts to the stragglers of the moment.

Known limits. Over the network this logic runs inside `training.sync_shard.ShardOwner` (with the job's
optimizer; `training.sync_runner` is the worker). This owner applies plain SGD. Workers are trusted to
compute honest gradients; only their form is checked.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "AsyncShardOwner",
    "GradientRejected",
    "StepUpdate",
    "Submission",
    "SyncAggregator",
    "SyncBackupOwner",
    "Verdict",
]


class GradientRejected(ValueError):
    """A malformed gradient submission (unknown sender, bad step, shape, dtype or non-finite value)."""


class Verdict(enum.StrEnum):
    """What the owner did with a well-formed gradient."""

    ACCEPTED = "accepted"  # counted towards the current step, which still waits for more
    APPLIED = "applied"  # counted, and completed the step (or applied on arrival, for async)
    LATE = "late"  # tagged with an older step: dropped (a backup worker's straggling gradient)
    FUTURE = "future"  # tagged with a step not reached yet: dropped
    DUPLICATE = "duplicate"  # this worker already counted for this step: dropped


@dataclasses.dataclass(frozen=True)
class StepUpdate:
    """The averaged gradient of one completed step.

    Attributes:
        step: the step the gradients were computed at (the parameters θ_step they apply to).
        mean_grads: name -> mean of the contributors' gradients.
        contributors: the N workers counted, in arrival order.
    """

    step: int
    mean_grads: dict[str, Tensor]
    contributors: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Submission:
    """Outcome of one submission: the verdict and, if it completed a step, the update."""

    verdict: Verdict
    update: StepUpdate | None = None


def _specs_of(params: Mapping[str, Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in params.items()}


class _Checker:
    """Form checks shared by the synchronous and asynchronous owners."""

    def __init__(self, worker_ids: Sequence[str], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
        if len(set(worker_ids)) != len(worker_ids) or not worker_ids:
            raise ValueError("worker_ids must be non-empty and distinct")
        if not specs:
            raise ValueError("the shard has no parameters")
        self.worker_ids = frozenset(worker_ids)
        self.specs = dict(specs)

    def check(self, worker_id: str, step: object, grads: Mapping[str, object]) -> int:
        if worker_id not in self.worker_ids:
            raise GradientRejected(f"gradient from unknown worker {worker_id!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise GradientRejected(f"worker {worker_id!r}: step must be a non-negative int, got {step!r}")
        if set(grads) != set(self.specs):
            missing, extra = set(self.specs) - set(grads), set(grads) - set(self.specs)
            raise GradientRejected(
                f"worker {worker_id!r}: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for name, (shape, dtype) in self.specs.items():
            grad = grads[name]
            if not isinstance(grad, Tensor):
                raise GradientRejected(f"worker {worker_id!r}: {name} is not a tensor")
            if tuple(grad.shape) != shape or grad.dtype != dtype:
                got = f"{tuple(grad.shape)} {grad.dtype}"
                raise GradientRejected(f"worker {worker_id!r}: {name} is {got}, expected {shape} {dtype}")
            if not bool(torch.isfinite(grad).all()):
                raise GradientRejected(f"worker {worker_id!r}: {name} has non-finite values")
        return step


class SyncAggregator:
    """Counts the first N well-formed gradients of the current step and yields their mean.

    Args:
        worker_ids: the N + b workers allowed to submit.
        num_to_aggregate: N (1 <= N <= len(worker_ids)); b = len(worker_ids) - N backups.
        specs: name -> (shape, dtype) of every gradient tensor of the shard.
        start_step: the step the shard's parameters are at.
    """

    def __init__(
        self,
        worker_ids: Sequence[str],
        num_to_aggregate: int,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        start_step: int = 0,
    ) -> None:
        if not 1 <= num_to_aggregate <= len(worker_ids):
            raise ValueError(f"num_to_aggregate must be in [1, {len(worker_ids)}], got {num_to_aggregate}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self._checker = _Checker(worker_ids, specs)
        self.num_to_aggregate = num_to_aggregate
        self._step = start_step
        self._sums: dict[str, Tensor] = {}
        self._contributors: list[str] = []
        self.dropped: collections.Counter[Verdict] = collections.Counter()

    @property
    def step(self) -> int:
        """The step being accumulated (gradients must be tagged with it)."""
        return self._step

    @property
    def num_pending(self) -> int:
        """Gradients counted so far for the current step."""
        return len(self._contributors)

    def fast_forward(self, step: int) -> bool:
        """Move the current step to `step` (later than now), dropping what was counted for the old one.

        For a shard taken over after its owner died: workers that got the dead owner's last reply are a
        step ahead of the new owner's copy. Returns whether the step moved.
        """
        if step <= self._step:
            return False
        self._step = step
        self._sums, self._contributors = {}, []
        return True

    def check(self, worker_id: str, step: object, grads: Mapping[str, object]) -> int:
        """The form checks of `submit` alone (sender, step, names, shapes, dtypes, finite); returns step.

        Raises:
            GradientRejected: malformed submission.
        """
        return self._checker.check(worker_id, step, grads)

    def submit(self, worker_id: str, step: int, grads: Mapping[str, Tensor]) -> Submission:
        """Offer one worker's gradient, computed on the parameters of ``step``.

        Raises:
            GradientRejected: malformed submission; nothing changes.
        """
        step = self._checker.check(worker_id, step, grads)
        if step != self._step or worker_id in self._contributors:
            verdict = (
                Verdict.LATE
                if step < self._step
                else Verdict.FUTURE
                if step > self._step
                else Verdict.DUPLICATE
            )
            self.dropped[verdict] += 1
            return Submission(verdict)
        for name, grad in grads.items():
            self._sums[name] = (
                self._sums[name] + grad.detach() if name in self._sums else grad.detach().clone()
            )
        self._contributors.append(worker_id)
        if len(self._contributors) < self.num_to_aggregate:
            return Submission(Verdict.ACCEPTED)
        update = StepUpdate(
            step=self._step,
            mean_grads={name: total / self.num_to_aggregate for name, total in self._sums.items()},
            contributors=tuple(self._contributors),
        )
        self._step += 1
        self._sums, self._contributors = {}, []
        return Submission(Verdict.APPLIED, update)


class SyncBackupOwner:
    """A parameter shard's owner running synchronous SGD with backup workers (plain SGD step).

    Args:
        params: the shard's initial parameters (copied).
        worker_ids: the N + b workers.
        num_to_aggregate: N.
        lr: SGD step size.
    """

    def __init__(
        self, params: Mapping[str, Tensor], worker_ids: Sequence[str], num_to_aggregate: int, *, lr: float
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self._params = {name: t.detach().clone() for name, t in params.items()}
        self.lr = lr
        self.aggregator = SyncAggregator(worker_ids, num_to_aggregate, _specs_of(self._params))
        self.history: list[StepUpdate] = []

    @property
    def step(self) -> int:
        """θ_step is what the owner holds; workers must tag gradients with it."""
        return self.aggregator.step

    def parameters(self) -> dict[str, Tensor]:
        """A copy of the current parameters (what a worker fetches with `step`)."""
        return {name: t.clone() for name, t in self._params.items()}

    def submit(self, worker_id: str, step: int, grads: Mapping[str, Tensor]) -> Submission:
        """See `SyncAggregator.submit`; a completed step is applied before returning."""
        result = self.aggregator.submit(worker_id, step, grads)
        if result.update is not None:
            for name, grad in result.update.mean_grads.items():
                self._params[name].sub_(grad.detach(), alpha=self.lr)
            self.history.append(result.update)
        return result


class AsyncShardOwner:
    """The asynchronous baseline: every well-formed gradient is applied on arrival, however stale.

    Args:
        params: the shard's initial parameters (copied).
        worker_ids: the workers.
        lr: SGD step size.
        max_staleness: if set, gradients staler than this are dropped as LATE (None: apply all).
    """

    def __init__(
        self,
        params: Mapping[str, Tensor],
        worker_ids: Sequence[str],
        *,
        lr: float,
        max_staleness: int | None = None,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self._params = {name: t.detach().clone() for name, t in params.items()}
        self._checker = _Checker(worker_ids, _specs_of(self._params))
        self.lr = lr
        self.max_staleness = max_staleness
        self._version = 0
        self.staleness_histogram: collections.Counter[int] = collections.Counter()
        self.dropped: collections.Counter[Verdict] = collections.Counter()

    @property
    def step(self) -> int:
        """Number of gradients applied so far (the version a worker reads with `parameters`)."""
        return self._version

    def parameters(self) -> dict[str, Tensor]:
        """A copy of the current parameters."""
        return {name: t.clone() for name, t in self._params.items()}

    def submit(self, worker_id: str, step: int, grads: Mapping[str, Tensor]) -> Submission:
        """Apply a gradient computed on version ``step`` now; record its staleness.

        Raises:
            GradientRejected: malformed submission; nothing changes.
        """
        step = self._checker.check(worker_id, step, grads)
        if step > self._version:
            self.dropped[Verdict.FUTURE] += 1
            return Submission(Verdict.FUTURE)
        staleness = self._version - step
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.dropped[Verdict.LATE] += 1
            return Submission(Verdict.LATE)
        for name, grad in grads.items():
            self._params[name].sub_(grad.detach(), alpha=self.lr)
        self.staleness_histogram[staleness] += 1
        self._version += 1
        return Submission(Verdict.APPLIED)
