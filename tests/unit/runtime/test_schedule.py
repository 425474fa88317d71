from __future__ import annotations

import pytest

from ravnest_p2p.runtime.schedule import gpipe_schedule, one_f_one_b_schedule, simulate_schedule


@pytest.mark.parametrize("make", [one_f_one_b_schedule, gpipe_schedule])
@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 1), (3, 2), (4, 8), (5, 20)])
def test_every_stage_runs_each_op_once_forward_first(make, stages, micro_batches):
    for ops in make(stages, micro_batches):
        assert sorted(ops) == sorted(
            [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]
        )
        for m in range(micro_batches):
            assert ops.index(("F", m)) < ops.index(("B", m))


def test_one_f_one_b_shape_and_memory_bound():
    schedule = one_f_one_b_schedule(4, 8)
    assert schedule[3][:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert schedule[0][:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    result = simulate_schedule(schedule, [1.0] * 4, [2.0] * 4)
    assert result.max_in_flight == (4, 3, 2, 1)
    assert simulate_schedule(gpipe_schedule(4, 8), [1.0] * 4, [2.0] * 4).max_in_flight == (8,) * 4


def test_makespan_of_uniform_pipeline_is_fill_plus_steady_state():
    # (S - 1) * (f + b) of fill/drain bubble plus M * (f + b) of work, for both schedules
    for make in (one_f_one_b_schedule, gpipe_schedule):
        result = simulate_schedule(make(4, 8), [1.0] * 4, [2.0] * 4)
        assert result.makespan_s == pytest.approx(3 * 3 + 8 * 3)
        assert result.bottleneck_bound_s == pytest.approx(24)
        assert result.busy_s == (24, 24, 24, 24)


def test_slowest_stage_dominates_long_runs():
    forward, backward = [1.0, 3.0, 1.0], [2.0, 6.0, 2.0]
    result = simulate_schedule(one_f_one_b_schedule(3, 200), forward, backward, link_s=0.5)
    assert result.bottleneck_bound_s == pytest.approx(200 * 9)
    assert 1.0 <= result.makespan_s / result.bottleneck_bound_s < 1.05
    assert max(result.utilisation) > 0.95


def test_links_delay_and_single_stage():
    assert simulate_schedule(one_f_one_b_schedule(2, 1), [1, 1], [1, 1], link_s=5).makespan_s == 14
    assert simulate_schedule(one_f_one_b_schedule(1, 3), [1], [2]).makespan_s == 9


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="micro-batch"):
        one_f_one_b_schedule(2, 0)
    with pytest.raises(ValueError, match="one entry per stage"):
        simulate_schedule(gpipe_schedule(2, 2), [1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="deadlocks"):
        simulate_schedule([[("B", 0), ("F", 0)]], [1.0], [1.0])
    with pytest.raises(ValueError, match="non-negative"):
        simulate_schedule(gpipe_schedule(1, 1), [-1.0], [1.0])
