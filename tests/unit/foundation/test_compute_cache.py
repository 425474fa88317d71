"""The compute figure's cache cannot poison itself: readings expire, and busy or absurd ones are not kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ravnest_p2p.measurement import compute
from ravnest_p2p.measurement.compute import (
    ComputeReading,
    measure_matmul_flops,
    quota_cpus,
    remeasure_matmul_flops,
)

CLEAN = ComputeReading(flops=40e9, cpu_share=1.95, allowed_cpus=2.0)
BUSY = ComputeReading(flops=0.047e9, cpu_share=0.4, allowed_cpus=2.0)  # the reading that once stuck


@pytest.fixture
def cache_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "ravnest_p2p" / "compute.json"


class Readings:
    def __init__(self, *readings: ComputeReading) -> None:
        self.left = list(readings)
        self.taken = 0

    def __call__(self) -> ComputeReading:
        self.taken += 1
        return self.left.pop(0)


def test_a_clean_reading_is_cached_and_reused(cache_file: Path) -> None:
    assert measure_matmul_flops(reader=Readings(CLEAN)) == 40e9
    again = Readings()
    assert measure_matmul_flops(reader=again) == 40e9
    assert again.taken == 0
    (entry,) = json.loads(cache_file.read_text()).values()
    assert [flops for flops, _ in entry["readings"]] == [40e9]


def test_a_busy_reading_is_never_cached_and_the_median_is_advertised(cache_file: Path) -> None:
    other = ComputeReading(flops=5e9, cpu_share=0.9, allowed_cpus=2.0)
    readings = Readings(BUSY, other, BUSY)
    assert measure_matmul_flops(reader=readings) == 0.047e9  # median of 0.047, 5, 0.047
    assert readings.taken == 3
    assert not cache_file.exists()
    # the next peer on the host measures afresh, and a clean reading ends the retries at once
    assert measure_matmul_flops(reader=Readings(BUSY, CLEAN)) == 40e9
    assert measure_matmul_flops(reader=Readings()) == 40e9


def test_a_quota_is_not_contention() -> None:
    capped = ComputeReading(flops=3e9, cpu_share=0.24, allowed_cpus=0.25)
    assert capped.cacheable
    assert not ComputeReading(flops=0.1e9, cpu_share=0.25, allowed_cpus=0.25).cacheable  # implausible
    assert ComputeReading(flops=1e12, cpu_share=0.0, allowed_cpus=None).cacheable  # a GPU: no CPU check


def test_an_old_figure_expires_and_a_fresh_one_replaces_it(cache_file: Path) -> None:
    measure_matmul_flops(reader=Readings(CLEAN))
    key = next(iter(json.loads(cache_file.read_text())))
    stale = {key: {"flops": 1e9, "measured_at": 0.0}}  # 1970: far past the age limit
    cache_file.write_text(json.dumps(stale))
    fresh = ComputeReading(flops=50e9, cpu_share=2.0, allowed_cpus=2.0)
    assert measure_matmul_flops(reader=Readings(fresh)) == 50e9
    assert [flops for flops, _ in json.loads(cache_file.read_text())[key]["readings"]] == [50e9]


@pytest.mark.parametrize(
    "value",
    [0.047e9, {"flops": 0.047e9, "measured_at": 1e18}, {"flops": 0.047e9, "measured_at": None}, "x"],
    ids=["old-format", "future", "no-time", "junk"],
)
def test_bad_cache_entries_are_measured_again(cache_file: Path, value: object) -> None:
    key = compute._cache_key("cpu", "float32")
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text(json.dumps({key: value, "other|key": {"flops": 1.0, "measured_at": 0}}))
    assert measure_matmul_flops(reader=Readings(CLEAN)) == 40e9
    assert json.loads(cache_file.read_text())["other|key"] == {"flops": 1.0, "measured_at": 0}


def test_an_implausible_cached_figure_is_ignored(cache_file: Path) -> None:
    import time

    key = compute._cache_key("cpu", "float32")
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text(json.dumps({key: {"flops": 0.047e9, "measured_at": time.time()}}))
    assert measure_matmul_flops(reader=Readings(CLEAN)) == 40e9


def test_quota_cpus() -> None:
    assert quota_cpus("25000 100000") == 0.25
    assert quota_cpus("13333") == 0.13333
    assert quota_cpus("max") is None
    assert quota_cpus("unknown in v2:/lab-0") is None


def _clean(gflops: float) -> ComputeReading:
    return ComputeReading(flops=gflops * 1e9, cpu_share=1.9, allowed_cpus=2.0)


def test_the_advertised_figure_is_the_median_of_recent_clean_readings(cache_file: Path) -> None:
    assert measure_matmul_flops(reader=Readings(_clean(40))) == 40e9
    # background readings refine it; a busy one is dropped and changes nothing
    assert remeasure_matmul_flops(reader=Readings(_clean(10))) == 25e9  # median of 40, 10
    assert remeasure_matmul_flops(reader=Readings(BUSY)) is None
    assert remeasure_matmul_flops(reader=Readings(_clean(38))) == 38e9  # median of 40, 10, 38
    # a new peer on the host reads the same median without measuring
    assert measure_matmul_flops(reader=Readings()) == 38e9
    for gflops in (41, 42, 43, 44):
        remeasure_matmul_flops(reader=Readings(_clean(gflops)))
    (entry,) = json.loads(cache_file.read_text()).values()
    assert [flops / 1e9 for flops, _ in entry["readings"]] == [38, 41, 42, 43, 44]  # the newest five


def test_expired_readings_leave_the_median(cache_file: Path) -> None:
    key = compute._cache_key("cpu", "float32")
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text(json.dumps({key: {"readings": [[1e9, 0.0], [2e9, 1.0]]}}))  # 1970
    assert remeasure_matmul_flops(reader=Readings(_clean(40))) == 40e9
    (entry,) = json.loads(cache_file.read_text()).values()
    assert [flops for flops, _ in entry["readings"]] == [40e9]
