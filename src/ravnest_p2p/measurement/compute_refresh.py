"""Keeping a long-lived peer's compute figure current: re-measure in the background, only while idle.

Problem: a volunteer's peer may run for days. Its compute figure was measured once at start (or read
from a cache up to `CACHE_MAX_AGE_S` old), while the host's speed changes: another user's jobs come and
go, thermal limits, a CPU quota set later. The planner places stages by that figure. So a running peer
takes another reading every `period_s` — but only while it is not training (a probe would steal the CPU
from its stage and, sharing it, read low anyway) — and advertises the median of its recent clean
readings (`compute.remeasure_matmul_flops`). A new figure is announced only when it moved by more than
`change_fraction`: the membership re-plans on changed inputs, and a re-plan for a 5 % wobble costs
more than it gains.

Alternatives rejected: re-measuring on a fixed timer regardless of state (contended readings while
training, and a probe that slows the stage it measures); measuring the stage's own compute while it
trains (a different quantity: it includes the model's memory traffic, and the planner's unit is a
matmul rate).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["ComputeRefresher"]

logger = logging.getLogger(__name__)


class ComputeRefresher:
    """Re-measures compute every `period_s` while `is_idle()`, and reports a changed figure.

    Args:
        period_s: time between readings.
        is_idle: whether a probe may run now (the peer is not training); checked every `retry_s`.
        remeasure: takes one reading; returns the new advertised figure, or None for a dropped
            (busy or implausible) reading.
        current: the figure advertised now.
        on_change: told the new figure when it differs from `current()` by more than `change_fraction`.
        sleep: awaitable delay (tests inject a fake clock).
    """

    def __init__(
        self,
        *,
        period_s: float,
        is_idle: Callable[[], bool],
        remeasure: Callable[[], Awaitable[float | None]],
        current: Callable[[], float],
        on_change: Callable[[float], None],
        change_fraction: float = 0.2,
        retry_s: float = 30.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if period_s <= 0 or retry_s <= 0 or change_fraction < 0:
            raise ValueError("period_s and retry_s must be > 0 and change_fraction >= 0")
        self.period_s = period_s
        self.is_idle = is_idle
        self.remeasure = remeasure
        self.current = current
        self.on_change = on_change
        self.change_fraction = change_fraction
        self.retry_s = retry_s
        self.sleep = sleep
        self.readings = 0  # readings taken (dropped ones included)

    async def run(self) -> None:
        """Forever: wait a period, wait until idle, take a reading, report a changed figure."""
        while True:
            await self.sleep(self.period_s)
            while not self.is_idle():
                await self.sleep(self.retry_s)
            await self.refresh_once()

    async def refresh_once(self) -> float | None:
        """One reading now; returns the new figure if it was announced."""
        self.readings += 1
        try:
            figure = await self.remeasure()
        except Exception as exc:  # a failed probe never ends the loop: the old figure stays
            logger.warning("background compute measurement failed: %r", exc)
            return None
        old = self.current()
        if figure is None or figure <= 0:
            return None
        if old > 0 and abs(figure - old) <= self.change_fraction * old:
            return None
        logger.info("compute figure moved: %.1f -> %.1f GFLOP/s", old / 1e9, figure / 1e9)
        self.on_change(figure)
        return figure
