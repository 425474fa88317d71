"""The pieces that make misbehaviour cost the sender: id window, ledger, rate limit, magnitude, poison."""

from __future__ import annotations

import pytest
import torch

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.models.spec import TensorSpec
from ravnest_p2p.runtime.admission import MicroBatchIds
from ravnest_p2p.runtime.config import NonFiniteResult, StageConfig
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.runtime.validation import check_matches, check_tensor
from ravnest_p2p.transport.ledger import PeerLedger, RateLimiter


def test_ids_refuse_replays_and_ids_outside_the_window():
    ids = MicroBatchIds(span=8)
    ids.check(0)
    ids.accept(0)
    ids.done(0)
    with pytest.raises(InvalidMessage, match="replay"):
        ids.check(0)
    for mb in range(1, 6):
        ids.check(mb)
        ids.accept(mb)
    with pytest.raises(InvalidMessage, match="window"):
        ids.check(5 + 9)  # too far ahead
    for mb in range(6, 30):
        ids.accept(mb)
    with pytest.raises(InvalidMessage, match="window"):
        ids.check(3)  # ancient (and forgotten from the done set): the window refuses it
    ids.check(30)


def test_ledger_excludes_at_the_threshold_once_per_epoch_and_forgives_on_a_new_epoch():
    excluded = []
    ledger = PeerLedger(threshold=3, on_exclude=lambda p, r: excluded.append(p))
    ledger.new_epoch(5)
    assert not ledger.count("a", "x")
    assert not ledger.count("a", "x")
    assert ledger.count("a", "x")
    assert not ledger.count("a", "x")  # already excluded: no second callback
    assert ledger.is_excluded("a")
    assert not ledger.is_excluded("b")
    assert excluded == ["a"]
    ledger.new_epoch(4)  # older: ignored
    assert ledger.is_excluded("a")
    ledger.new_epoch(6)
    assert not ledger.is_excluded("a")
    assert ledger.refused["a"] == 0


def test_rate_limiter_is_per_sender_and_refills():
    limiter = RateLimiter(rate_per_s=1.0, burst=2, max_senders=4)
    assert limiter.allow("a", 0.0)
    assert limiter.allow("a", 0.0)
    assert not limiter.allow("a", 0.0)
    assert limiter.allow("b", 0.0)  # another sender is not starved
    assert limiter.allow("a", 1.01)  # refilled one token
    for i in range(100):  # a flood of fresh identities keeps memory bounded
        limiter.allow(f"fresh{i}", 2.0)
    assert len(limiter._buckets) <= 4


def test_magnitude_bound_refuses_finite_but_huge_values_and_nan():
    spec = TensorSpec((3,), torch.float32)
    ok = torch.ones(2, 3)
    check_tensor(ok, spec, "x", max_abs=10.0)
    with pytest.raises(InvalidMessage, match="beyond"):
        check_tensor(ok * 1e30, spec, "x", max_abs=1e6)
    with pytest.raises(InvalidMessage, match="beyond"):
        check_tensor(-ok * 1e7, spec, "x", max_abs=1e6)
    nan = ok.clone()
    nan[1, 1] = float("nan")
    with pytest.raises(InvalidMessage):
        check_tensor(nan, spec, "x", max_abs=1e6)
    with pytest.raises(InvalidMessage):
        check_matches(ok * 1e9, ok.shape, ok.dtype, "g", max_abs=1e6)
    labels = TensorSpec((), torch.int64, high=10)
    with pytest.raises(InvalidMessage, match="values must lie"):
        check_tensor(torch.tensor([3, 10]), labels, "labels", max_abs=1e6)


def _executor(is_last: bool) -> StageExecutor:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)]
    return StageExecutor(
        StageConfig(first_layer_index=1, is_last=is_last, max_in_flight=4),
        layers,
        input_spec=TensorSpec((4,), torch.float32),
        label_spec=TensorSpec((), torch.int64, high=3) if is_last else None,
    )


def _digest(ex: StageExecutor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ex.parameters_by_name().values()]


def test_overflowing_input_drops_the_micro_batch_before_any_step():
    ex = _executor(is_last=True)
    with torch.no_grad():
        ex.module[0].weight.fill_(1.0)  # so that a finite input overflows the first layer
    before = _digest(ex)
    x = torch.full((2, 4), 3e38)
    with pytest.raises(NonFiniteResult):
        ex.forward_loss(0, x, torch.tensor([0, 1]))
    assert ex.num_steps == 0
    assert ex.weight_version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _digest(ex), strict=True))
    ex.forward_loss(1, torch.randn(2, 4), torch.tensor([0, 1]))  # and it still trains
    assert ex.num_steps == 1


def test_non_finite_gradient_releases_the_micro_batch_and_release_frees_the_stash():
    ex = _executor(is_last=False)
    before = _digest(ex)
    out = ex.forward(0, torch.randn(2, 4))
    ex.forward(1, torch.randn(2, 4))
    with pytest.raises(NonFiniteResult):
        ex.backward(0, torch.full_like(out, 3e38))
    assert ex.in_flight == (1,)
    assert ex.num_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _digest(ex), strict=True))
    assert ex.release(1)
    assert not ex.release(1)
    assert ex.in_flight == ()
    ex.forward(2, torch.randn(2, 4))
    assert ex.release_all() == 1
    assert ex.in_flight == ()
