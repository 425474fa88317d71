"""The background compute re-measurement: only while idle, and a figure announced only when it moved."""

from __future__ import annotations

import asyncio

import pytest

from ravnest_p2p.measurement.compute_refresh import ComputeRefresher


class Clock:
    """A fake sleep: records the delays and lets the test decide when the loop stops."""

    def __init__(self, limit: int) -> None:
        self.delays: list[float] = []
        self.limit = limit

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        if len(self.delays) > self.limit:
            raise asyncio.CancelledError


def _refresher(
    clock: Clock, figures: list[float | None], idle: list[bool], seen: list[float]
) -> ComputeRefresher:
    state = {"flops": 40e9}

    async def remeasure() -> float | None:
        return figures.pop(0)

    def changed(flops: float) -> None:
        state["flops"] = flops
        seen.append(flops)

    return ComputeRefresher(
        period_s=3600.0,
        retry_s=30.0,
        is_idle=lambda: idle.pop(0) if idle else True,
        remeasure=remeasure,
        current=lambda: state["flops"],
        on_change=changed,
        sleep=clock.sleep,
    )


async def test_readings_wait_for_an_idle_peer_and_small_moves_are_not_announced() -> None:
    clock, seen = Clock(limit=4), []
    # period; busy twice (two retries); reading 44 (+10 %: kept quiet); period; reading 20 (announced);
    # the next period's sleep ends the test
    refresher = _refresher(clock, [44e9, 20e9], idle=[False, False, True, True], seen=seen)
    with pytest.raises(asyncio.CancelledError):
        await refresher.run()
    assert clock.delays[:5] == [3600.0, 30.0, 30.0, 3600.0, 3600.0]
    assert seen == [20e9]
    assert refresher.readings == 2


async def test_a_dropped_or_failed_reading_keeps_the_old_figure() -> None:
    seen: list[float] = []
    refresher = _refresher(Clock(limit=0), [None], idle=[], seen=seen)
    assert await refresher.refresh_once() is None

    async def broken() -> float | None:
        raise RuntimeError("probe failed")

    refresher.remeasure = broken
    assert await refresher.refresh_once() is None
    assert seen == []


def test_bad_settings_are_refused() -> None:
    async def never() -> float | None:
        return None

    with pytest.raises(ValueError, match="period_s"):
        ComputeRefresher(
            period_s=0, is_idle=lambda: True, remeasure=never, current=lambda: 1.0, on_change=print
        )
