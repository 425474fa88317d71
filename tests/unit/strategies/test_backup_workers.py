"""Synchronous SGD with backup workers (Chen et al., arXiv 1604.00981) and the async baseline, in process."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from ravnest_p2p.strategies.backup_workers import (
    AsyncShardOwner,
    GradientRejected,
    SyncAggregator,
    SyncBackupOwner,
    Verdict,
)

LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(
    num_steps: int, num_workers: int, batch_size: int = 8
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randn(batch_size, 6, generator=gen), torch.randint(0, 3, (batch_size,), generator=gen))
            for _ in range(num_workers)
        ]
        for _ in range(num_steps)
    ]


def _gradient(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    model.load_state_dict(params)
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _large_batch_sgd(
    batches_per_step: list[list[tuple[torch.Tensor, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    model = _model()
    for batches in batches_per_step:
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():  # plain SGD (torch.optim's first step pays seconds of lazy imports)
            for p in model.parameters():
                p -= LR * p.grad
    return {name: p.detach() for name, p in model.named_parameters()}


def test_b0_equals_single_process_large_batch_sgd():
    workers = [f"w{i}" for i in range(4)]
    owner = SyncBackupOwner(dict(_model().named_parameters()), workers, 4, lr=LR)
    replica = _model()
    steps = _batches(6, 4)
    order = random.Random(2)
    for batches in steps:
        params, step = owner.parameters(), owner.step
        grads = [_gradient(replica, params, x, y) for x, y in batches]
        arrival = list(range(4))
        order.shuffle(arrival)
        verdicts = [owner.submit(workers[i], step, grads[i]).verdict for i in arrival]
        assert verdicts == [Verdict.ACCEPTED] * 3 + [Verdict.APPLIED]
    assert owner.step == 6
    expected = _large_batch_sgd(steps)
    for name, value in owner.parameters().items():
        torch.testing.assert_close(value, expected[name], atol=1e-5, rtol=0)


def test_b1_uses_the_first_n_and_drops_the_straggler_every_step():
    workers = [f"w{i}" for i in range(5)]
    straggler = "w4"
    owner = SyncBackupOwner(dict(_model().named_parameters()), workers, 4, lr=LR)
    replica = _model()
    steps = _batches(5, 5)
    order = random.Random(3)
    for batches in steps:
        params, step = owner.parameters(), owner.step
        grads = {w: _gradient(replica, params, x, y) for w, (x, y) in zip(workers, batches, strict=True)}
        fast = workers[:4]
        order.shuffle(fast)
        for w in fast:
            owner.submit(w, step, grads[w])
        # the straggler's gradient of this step arrives after the step completed: never applied
        before = owner.parameters()
        late = owner.submit(straggler, step, grads[straggler])
        assert late.verdict is Verdict.LATE
        assert late.update is None
        for name, value in owner.parameters().items():
            assert torch.equal(value, before[name])
        assert set(owner.history[-1].contributors) == set(workers[:4])
    assert owner.aggregator.dropped[Verdict.LATE] == 5
    # the result is large-batch SGD over the four fast workers' batches only
    expected = _large_batch_sgd([b[:4] for b in steps])
    for name, value in owner.parameters().items():
        torch.testing.assert_close(value, expected[name], atol=1e-5, rtol=0)


def test_stale_future_and_duplicate_gradients_are_never_counted():
    agg = SyncAggregator(["a", "b", "c"], 2, {"w": ((2,), torch.float32)}, start_step=3)
    huge = {"w": torch.full((2,), 1e6)}
    assert agg.submit("a", 2, huge).verdict is Verdict.LATE
    assert agg.submit("a", 4, huge).verdict is Verdict.FUTURE
    assert agg.num_pending == 0
    assert agg.submit("a", 3, {"w": torch.ones(2)}).verdict is Verdict.ACCEPTED
    assert agg.submit("a", 3, huge).verdict is Verdict.DUPLICATE
    done = agg.submit("c", 3, {"w": torch.full((2,), 3.0)})
    assert done.verdict is Verdict.APPLIED
    assert done.update is not None
    assert done.update.step == 3
    assert done.update.contributors == ("a", "c")
    assert torch.equal(done.update.mean_grads["w"], torch.full((2,), 2.0))
    assert agg.step == 4
    assert agg.submit("b", 3, huge).verdict is Verdict.LATE  # b was the backup of step 3
    assert dict(agg.dropped) == {Verdict.LATE: 2, Verdict.FUTURE: 1, Verdict.DUPLICATE: 1}


@pytest.mark.parametrize(
    ("worker", "step", "grads", "match"),
    [
        ("mallory", 0, {"w": torch.ones(2)}, "unknown worker"),
        ("a", -1, {"w": torch.ones(2)}, "non-negative int"),
        ("a", True, {"w": torch.ones(2)}, "non-negative int"),
        ("a", 0.0, {"w": torch.ones(2)}, "non-negative int"),
        ("a", 0, {}, "missing"),
        ("a", 0, {"w": torch.ones(2), "x": torch.ones(1)}, "unexpected"),
        ("a", 0, {"w": torch.ones(3)}, "expected"),
        ("a", 0, {"w": torch.ones(2, dtype=torch.float64)}, "expected"),
        ("a", 0, {"w": torch.tensor([1.0, float("nan")])}, "non-finite"),
        ("a", 0, {"w": torch.tensor([1.0, float("inf")])}, "non-finite"),
        ("a", 0, {"w": [1.0, 2.0]}, "not a tensor"),
    ],
)
def test_malformed_gradients_are_refused_and_change_nothing(worker, step, grads, match):
    sync = SyncBackupOwner({"w": torch.zeros(2)}, ["a", "b"], 2, lr=1.0)
    sync.submit("b", 0, {"w": torch.ones(2)})
    asyn = AsyncShardOwner({"w": torch.zeros(2)}, ["a", "b"], lr=1.0)
    for owner in (sync, asyn):
        with pytest.raises(GradientRejected, match=match):
            owner.submit(worker, step, grads)
        assert torch.equal(owner.parameters()["w"], torch.zeros(2))
        assert owner.step == 0
    assert sync.aggregator.num_pending == 1


def test_async_baseline_applies_on_arrival_and_records_staleness():
    workers = [f"w{i}" for i in range(4)]
    owner = AsyncShardOwner({"w": torch.zeros(2)}, workers, lr=1.0)
    # every worker reads version 0, then they arrive one after another: staleness 0, 1, 2, 3
    for w in workers:
        assert owner.submit(w, 0, {"w": torch.ones(2)}).verdict is Verdict.APPLIED
    assert owner.step == 4
    assert dict(owner.staleness_histogram) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert torch.equal(owner.parameters()["w"], torch.full((2,), -4.0))  # stale ones applied too
    # steady state, round robin: each worker re-reads right after its own apply -> staleness N - 1
    read = {w: owner.step - 3 + i for i, w in enumerate(workers)}
    for _ in range(5):
        for w in workers:
            owner.submit(w, read[w], {"w": torch.zeros(2)})
            read[w] = owner.step
    assert owner.staleness_histogram[3] == 1 + 20
    assert owner.submit("w0", owner.step + 1, {"w": torch.ones(2)}).verdict is Verdict.FUTURE
    bounded = AsyncShardOwner({"w": torch.zeros(2)}, workers, lr=1.0, max_staleness=1)
    for w in workers:
        bounded.submit(w, 0, {"w": torch.ones(2)})
    assert bounded.step == 2
    assert bounded.dropped[Verdict.LATE] == 2


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="num_to_aggregate"):
        SyncAggregator(["a"], 2, {"w": ((1,), torch.float32)})
    with pytest.raises(ValueError, match="distinct"):
        SyncAggregator(["a", "a"], 1, {"w": ((1,), torch.float32)})
    with pytest.raises(ValueError, match="lr"):
        SyncBackupOwner({"w": torch.zeros(1)}, ["a"], 1, lr=0.0)


def test_fast_forward_moves_only_ahead_and_drops_what_was_counted():
    specs = {"w": ((2,), torch.float32)}
    agg = SyncAggregator(["a", "b", "c"], 2, specs, start_step=2)
    assert agg.submit("a", 2, {"w": torch.ones(2)}).verdict == Verdict.ACCEPTED
    assert agg.submit("b", 3, {"w": torch.ones(2)}).verdict == Verdict.FUTURE
    assert not agg.fast_forward(2)  # not ahead: nothing changes
    assert agg.num_pending == 1
    assert agg.fast_forward(3)
    assert (agg.step, agg.num_pending) == (3, 0)  # step 2's partial sum is gone, never applied
    assert agg.submit("a", 2, {"w": torch.ones(2)}).verdict == Verdict.LATE
    assert agg.submit("b", 3, {"w": torch.ones(2)}).verdict == Verdict.ACCEPTED
    update = agg.submit("c", 3, {"w": 3 * torch.ones(2)}).update
    assert update is not None
    assert update.step == 3
    assert torch.equal(update.mean_grads["w"], 2 * torch.ones(2))
