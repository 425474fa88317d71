"""Waits stretch with the host's load: a fixed deadline tuned to a quiet machine fails a healthy wait."""

from __future__ import annotations

import pytest

from ravnest_p2p import swarm
from ravnest_p2p.utils import aio
from ravnest_p2p.utils.aio import StretchedDeadline, load_stretch, wait_until


def _load(monkeypatch: pytest.MonkeyPatch, load: float, cpus: int = 2, runnable: int = 0) -> None:
    monkeypatch.setattr(aio.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(aio, "_run_queue", lambda: runnable)
    monkeypatch.setattr(aio.os, "sched_getaffinity", lambda _pid: set(range(cpus)))


@pytest.mark.parametrize(("load", "stretch"), [(0.3, 1.0), (2.0, 1.0), (6.0, 3.0), (60.0, 6.0)])
def test_the_stretch_is_the_load_per_cpu_between_1_and_6(
    monkeypatch: pytest.MonkeyPatch, load: float, stretch: float
) -> None:
    _load(monkeypatch, load)
    assert load_stretch() == stretch


def test_a_host_that_just_got_busy_stretches_before_its_load_average_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _load(monkeypatch, 0.2, runnable=8)  # the 1-minute average still reads the quiet minute before
    assert load_stretch() == 4.0


def test_the_run_queue_counts_the_other_runnable_tasks(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 7\nprocs_blocked 0\n")
    monkeypatch.setattr(aio, "_PROC_STAT", str(stat))
    assert aio._run_queue() == 6  # this process is one of the 7
    monkeypatch.setattr(aio, "_PROC_STAT", str(tmp_path / "absent"))
    assert aio._run_queue() == 0


def test_a_deadline_lasts_timeout_times_the_largest_stretch_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(aio.time, "monotonic", lambda: clock[0])
    _load(monkeypatch, 1.0)
    deadline = StretchedDeadline(10.0)
    clock[0] = 109.0
    assert not deadline.expired()
    _load(monkeypatch, 8.0)  # the host got busy: x4
    clock[0] = 139.0
    assert not deadline.expired()
    _load(monkeypatch, 1.0)  # it calmed down, but the wait already ran under load
    assert not deadline.expired()
    clock[0] = 140.0
    assert deadline.expired()
    assert "x4.0 for the host's load" in deadline.describe()


async def test_wait_until_on_a_quiet_host_times_out_on_time(monkeypatch: pytest.MonkeyPatch) -> None:
    _load(monkeypatch, 0.1)
    with pytest.raises(TimeoutError, match="waiting for never"):
        await wait_until(lambda: False, 0.05, interval_s=0.01, message="never")


def test_poll_until_names_what_it_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    _load(monkeypatch, 0.1)
    with pytest.raises(TimeoutError, match="waiting for peer0"):
        swarm.poll_until(lambda: False, 0.05, what="peer0", interval_s=0.01)
