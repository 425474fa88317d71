"""bench_bytes_to_target's arithmetic: evaluations from the driver's trace, bytes and wall to the target."""

from __future__ import annotations

from typing import Any

import pytest
from benchmarks.bytes_target_report import curve, summarise


def _final(cluster: int, loss: float, sent: int, wall: float, rounds: int) -> dict[str, Any]:
    return {
        "cluster": cluster,
        "step": 100,
        "eval_loss": loss,
        "averaging_bytes_sent": sent,
        "train_wall_s": wall,
        "averaging_rounds": rounds,
    }


def _run(evals: list[tuple[int, float, int]], final_loss: float, final_bytes: int, rounds: int) -> dict:
    """Two clusters; per evaluation (step, loss, bytes); each polled twice, once late by 3 steps."""
    trace = [{"t": 0.0, "load": 4.0, "stages": [[0, 0, 10, None, 0, 0, 0.5], [1, 0, 10, None, 0, 0, 0.5]]}]
    for step, loss, sent in evals:
        for late in (0, 3):  # the same evaluation seen again by a later poll: counted once, at its first
            trace.append(
                {
                    "t": step / 10,
                    "load": 6.0,
                    "stages": [
                        [0, 0, step + late, loss - 0.1, sent + late, 1, step / 10],
                        [1, 0, step + late, loss + 0.1, sent + late, 1, step / 10 + 1],
                    ],
                }
            )
    metrics = [_final(c, final_loss, final_bytes, 12.0, rounds) for c in (0, 1)]
    return {"trace": trace, "metrics": metrics}


def test_the_curve_averages_clusters_per_evaluation_and_ends_after_the_closing_round() -> None:
    got = curve(_run([(50, 2.0, 1000), (100, 1.5, 2000)], 1.4, 2500, rounds=3), every=50)
    assert [p["step"] for p in got["points"]] == [50, 100, 100]
    first = got["points"][0]
    assert first["loss"] == pytest.approx(2.0)
    assert first["loss_max"] == pytest.approx(2.1)
    assert first["bytes_per_peer"] == 1000  # the first poll that shows the new loss, not the later one
    assert first["wall_s"] == pytest.approx(6.0)  # the slowest cluster
    last = got["points"][-1]
    assert (last["loss"], last["bytes_per_peer"], last["final"]) == (pytest.approx(1.4), 2500, True)
    assert got["load_1min"] == pytest.approx(5.6)


def test_bytes_to_target_are_the_first_evaluation_at_or_below_every_steps_final_loss() -> None:
    every = {"mode": "every step", **curve(_run([(50, 2.0, 4000)], 1.5, 8000, rounds=4), every=50)}
    periodic = {"mode": "periodic 128", **curve(_run([(50, 2.1, 0)], 1.5, 2000, rounds=1), every=50)}
    outer = {"mode": "outer H=10", **curve(_run([(50, 1.5, 100)], 1.45, 900, rounds=6), every=50)}
    rows = {r["mode"]: r for r in summarise([every, periodic, outer])}
    assert rows["every step"]["mb_to_target"] == pytest.approx(0.008)
    assert rows["outer H=10"]["mb_to_target"] == pytest.approx(0.0001)  # reached at step 50
    assert rows["outer H=10"]["step_to_target"] == 50
    assert rows["outer H=10"]["x_vs_every_step"] == 80.0
    assert rows["outer H=10"]["x_vs_periodic"] == 20.0
    # every step's 2000 B per round x the 100 steps it needed, against 100 B
    assert rows["outer H=10"]["x_vs_a_round_every_step"] == 2000.0
    assert rows["outer H=10"]["final_vs_every_step"] == pytest.approx(1.45 / 1.5, abs=1e-4)
    # within 2 %: every step is within 1.02 x 1.5 = 1.53 only at its end, periodic at its end too
    assert rows["outer H=10"]["mb_to_2pct"] == pytest.approx(0.0001)
    assert rows["outer H=10"]["x_vs_every_step_2pct"] == 80.0
