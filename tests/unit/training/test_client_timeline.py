"""The pipeline timeline: compute, send and idle shares per stage from the counters stages publish."""

from __future__ import annotations

from typing import Any

import pytest

from ravnest_p2p import StageMetrics, summarize
from ravnest_p2p.client_timeline import stage_intervals, stage_sample
from ravnest_p2p.client_watch import JobHistory


def _stage(stage: int, updated_at: float, compute_s: float, send_s: float, **fields: Any) -> StageMetrics:
    values: dict[str, Any] = {
        "job_id": "digits-1",
        "peer_id": f"Qm{'x' * 40}{stage}",
        "cluster": 0,
        "stage": stage,
        "num_stages": 2,
        "step": 10,
        "optimizer_steps": 10,
        "updated_at": updated_at,
        "compute_s": compute_s,
        "send_busy_s": send_s,
    }
    return StageMetrics(**{**values, **fields})


def test_shares_come_from_the_stage_clock_and_sum_to_one() -> None:
    samples = [
        stage_sample(_stage(0, 10.0, 1.0, 0.5), elapsed_s=0.0),
        stage_sample(_stage(0, 10.0, 1.0, 0.5), elapsed_s=1.0),  # seen again unchanged: skipped
        stage_sample(_stage(0, 14.0, 3.0, 1.5), elapsed_s=2.5),  # 4 s: compute 2 s, send 1 s
        stage_sample(_stage(0, 16.0, 4.9, 3.0), elapsed_s=4.0),  # 2 s: compute 1.9 s, send 1.5 s (overlap)
    ]
    (spans,) = stage_intervals(samples).values()
    first, second = spans
    assert (first.start_s, first.end_s) == (0.0, 2.5)
    assert (first.compute, first.send, first.idle) == pytest.approx((0.5, 0.25, 0.25))
    # sending that overlapped compute is shown as compute: the bands never exceed the interval
    assert (second.compute, second.send, second.idle) == pytest.approx((0.95, 0.05, 0.0))
    for span in spans:
        assert span.compute + span.send + span.idle == pytest.approx(1.0)


def test_a_restarted_runner_never_gives_a_negative_interval() -> None:
    samples = [
        stage_sample(_stage(1, 10.0, 5.0, 1.0), elapsed_s=0.0),
        stage_sample(_stage(1, 12.0, 0.5, 0.1), elapsed_s=2.0),  # counters restarted
        stage_sample(_stage(1, 14.0, 1.5, 0.1), elapsed_s=4.0),
    ]
    (spans,) = stage_intervals(samples).values()
    assert [(s.start_s, s.compute) for s in spans] == [(2.0, pytest.approx(0.5))]


def test_stages_of_different_epochs_and_peers_are_separate_rows() -> None:
    samples = [
        stage_sample(_stage(0, t, t / 2, 0.0, epoch=epoch), elapsed_s=t)
        for epoch in (1, 2)
        for t in (1.0, 2.0)
    ]
    assert sorted(key[0] for key in stage_intervals(samples)) == [1, 2]


def test_watch_history_keeps_every_stage_and_draws_the_timeline() -> None:
    history = JobHistory(job_id="digits-1", started_at=100.0)
    for now, t in ((101.0, 10.0), (103.0, 12.0), (105.0, 14.0)):
        poll = [_stage(0, t, t * 0.6, t * 0.1), _stage(1, t, t * 0.3, t * 0.2, loss=0.5)]
        history.add(summarize(poll), now=now, metrics=poll)
    assert len(history.stages) == 6
    intervals = stage_intervals(history.stages)
    assert {key[2] for key in intervals} == {0, 1}
    assert all(span.compute == pytest.approx(0.6) for span in intervals[next(iter(intervals))])
    pytest.importorskip("matplotlib")
    assert history.timeline_png().startswith(b"\x89PNG")
    empty = JobHistory(job_id="digits-2")
    assert empty.timeline_png().startswith(b"\x89PNG")  # an empty timeline still draws (with a note)
