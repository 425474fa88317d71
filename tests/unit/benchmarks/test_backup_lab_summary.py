"""The lab straggler benchmark's arithmetic: the per-step N-th order statistic and the summary row."""

from __future__ import annotations

import pytest
from benchmarks.bench_backup_lab import NUM_REQUIRED, WARMUP, matched_step_s, nth_per_step, summarise


def _timing(peer: str, times: list[float], *, late: int = 0, job: str = "j", **extra: object) -> dict:
    return {
        "job_id": job,
        "peer_id": peer,
        "steps": len(times) if not late else 10,
        "iterations": len(times),
        "late": late,
        "train_s": extra.pop("train_s", sum(times)),
        "gradient_times_s": times,
        "shards_owned": [],
        "staleness": extra.pop("staleness", {}),
        "dropped": {},
        **extra,
    }


def test_the_order_statistic_is_taken_per_step_with_the_late_straggler_at_its_mean() -> None:
    assert NUM_REQUIRED == 4
    fast = [
        _timing("a", [1.0] * WARMUP + [1.0, 1.0]),
        _timing("b", [1.0] * WARMUP + [1.0, 1.0]),
        _timing("c", [1.0] * WARMUP + [2.0, 1.0]),
        _timing("d", [1.0] * WARMUP + [1.0, 3.0]),
    ]
    straggler = _timing("s", [9.0, 9.0], late=5)
    # step WARMUP: 4th smallest of (1, 1, 2, 1, 9) = 2; step WARMUP + 1: of (1, 1, 1, 3, 9) = 3
    assert nth_per_step([*fast, straggler], "s") == pytest.approx(2.5)


def test_the_summary_compares_b1_with_b0_at_equal_steps() -> None:
    def run(name: str, step_s: float, accuracy: float, workers: int) -> dict:
        return {
            "run": name,
            "job_id": name,
            "workers": ["p"] * workers,
            "began": 0.0,
            "ended": 10.0,
            "metrics": [{"done": True, "eval_accuracy": accuracy}],
        }

    timings = [_timing(p, [1.0] * 10, job="b1", train_s=12.0) for p in "abcd"] + [
        _timing("s", [3.0] * 3, late=7, job="b1")
    ]
    timings += [_timing(p, [1.0] * 10, job="b0", train_s=33.0) for p in "abc"]
    timings += [_timing("s", [3.0] * 10, job="b0")]
    lab = {
        "straggler": "s",
        "timings": timings,
        "results": [run("b1", 1.2, 0.97, 5), run("b0", 3.3, 0.975, 4)],
    }
    rows = {row["run"]: row for row in summarise(lab)}
    assert rows["b1"]["step_s"] == pytest.approx(1.2)
    assert rows["b1"]["nth_per_step_s"] == pytest.approx(1.0)
    assert rows["b0"]["nth_per_step_s"] == pytest.approx(3.0)
    assert rows["b1"]["step_reduction_vs_b0"] == pytest.approx(1 - 1.2 / 3.3, abs=1e-3)
    assert rows["b1"]["accuracy_minus_b0_points"] == pytest.approx(-0.5)
    assert rows["b1"]["straggler_late"] == 7


def test_the_step_time_covers_the_steps_the_order_statistic_covers() -> None:
    slow_start = [2.0] * WARMUP + [1.0] * 8  # the first gradients' allocations, left out of both
    timing = _timing("a", [0.9] * 10, step_times_s=slow_start, train_s=sum(slow_start))
    assert matched_step_s(timing) == pytest.approx(1.0)
    assert matched_step_s(_timing("b", [1.0] * 10, train_s=12.0)) == pytest.approx(1.2)  # no step times
