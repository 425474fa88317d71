"""bench_placement's merge: a hard-case run that beats the reference becomes it, with its placement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import bench_placement, harness, placement_cases


def _row(seed: int, cost: float, placement: list[list[int]] | None) -> dict[str, object]:
    row: dict[str, object] = {
        "part": "hard", "case": "hard-2x2-s0", "method": "ours", "seed": seed, "reference_s": None,
        "cost_s": cost, "ratio": None, "cpu_s": 60.0, "load_1min": 1.0,
    }  # fmt: skip
    if placement is not None:
        row["placement"] = placement
    return row


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(bench_placement, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench_placement, "PARTS_DIR", tmp_path / "parts")
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(placement_cases, "REFERENCES", tmp_path / "refs.json")
    return tmp_path


def test_a_run_that_beats_the_reference_is_stored_with_its_placement(dirs: Path) -> None:
    long_runs = [{"cost_s": 10.5, "method": "600 s run", "budget_cpu_s": 600.0}]
    older = {"cost_s": 10.2, "method": "older"}
    placement_cases.save_references(
        {"hard-2x2-s0": {"cost_s": 10.0, "method": "long run", "previous": older, "long_runs": long_runs}}
    )
    rows = [_row(0, 11.0, [[0, 1], [2, 3]]), _row(1, 9.5, [[0, 2], [1, 3]]), _row(2, 9.9, None)]
    (dirs / "parts").mkdir()
    (dirs / "parts" / "hard.json").write_text(json.dumps({"rows": rows, "curves": {}, "settings": {}}))

    bench_placement.merge({"budget_cpu_s": 60.0})

    ref = placement_cases.load_references()["hard-2x2-s0"]
    assert ref["cost_s"] == 9.5
    assert ref["placement"] == [[0, 2], [1, 3]]
    assert ref["seed"] == 1
    # the replaced entry and the long runs stay on record
    assert ref["previous"] == {"cost_s": 10.0, "method": "long run", "previous": older}
    assert ref["long_runs"] == long_runs
    written = json.loads((dirs / "placement.json").read_text())["rows"]
    assert [r["ratio"] for r in written] == pytest.approx([11.0 / 9.5, 1.0, 9.9 / 9.5])
    assert all("placement" not in r for r in written)  # placements stay in the part files
    table = (dirs / "placement.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| part"))
    assert "placement" not in header
