"""The fused value check (`transport.codec_values`): finite and within a bound, one pass, remembered."""

from __future__ import annotations

import gc

import pytest
import torch

from ravnest_p2p.transport import codec_values
from ravnest_p2p.transport.codec_values import all_finite, int_range, within

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_non_finite_values_fail_with_and_without_a_bound(dtype: torch.dtype) -> None:
    for bad in (NAN, INF, -INF):
        t = torch.ones(100, dtype=dtype)
        t[57] = bad
        assert not all_finite(t)
        assert not within(t, 1e4)
    assert all_finite(torch.ones(100, dtype=dtype))
    assert within(torch.empty(0, dtype=dtype), 1.0)


def test_the_bound_is_exact_where_the_sum_of_squares_cannot_decide() -> None:
    huge = torch.full((100,), 3e38)  # finite, but the squares overflow
    assert all_finite(huge)
    assert not within(huge, 1e10)
    many = torch.full((10_000,), 0.9e10)  # each within 1e10, the sum of squares far beyond 1e20
    assert within(many, 1e10)
    edge = torch.tensor([1.0, -1e10])
    assert within(edge, 1e10)
    assert not within(edge, 0.99e10)


def test_an_in_place_change_voids_what_was_proved() -> None:
    t = torch.randn(1000)
    assert within(t, 1e10)
    t[3] = NAN
    assert not all_finite(t)
    t[3] = 2e10
    assert all_finite(t)
    assert not within(t, 1e10)
    t.mul_(0.1)
    assert within(t, 1e10)


def test_a_record_goes_with_its_tensor() -> None:
    before = len(codec_values._PROOFS)
    tensors = [torch.randn(64) for _ in range(50)]
    assert all(within(t, 1e10) for t in tensors)
    assert len(codec_values._PROOFS) == before + 50
    assert all(all_finite(g, remember=False) for g in (torch.randn(8), torch.randn(8)))
    assert len(codec_values._PROOFS) == before + 50
    del tensors
    gc.collect()
    assert len(codec_values._PROOFS) == before


def test_a_second_check_of_the_same_tensor_reads_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(32, 16)
    assert within(t)  # as decoding does
    calls = []
    monkeypatch.setattr(codec_values, "_exact", lambda *a: calls.append(a))
    monkeypatch.setattr(codec_values.np, "dot", lambda *a: calls.append(a))
    assert within(t, 1e10)  # the handler's bound, then the executor's finiteness
    assert all_finite(t)
    assert calls == []


def test_non_contiguous_and_complex_tensors() -> None:
    assert within(torch.randn(8, 4).t(), 10.0)
    assert not within(torch.full((4, 8), 20.0).t(), 10.0)
    assert all_finite(torch.tensor([1 + 1j, 2j]))
    assert not all_finite(torch.tensor([complex(NAN, 0.0)]))


def test_int_range_is_exact_and_follows_changes() -> None:
    labels = torch.tensor([3, 0, 9, 2**60])
    assert int_range(labels) == (0, 2**60)
    labels[0] = -1
    assert int_range(labels) == (-1, 2**60)
