"""Asyncio helpers: every task has an owner, polling has a deadline, torch runs on one thread."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["StretchedDeadline", "TaskOwner", "load_stretch", "run_in_compute_thread", "wait_until"]

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Torch compute is the only thing that runs off the event loop, and it runs on this one thread so that
# stages never race each other for the (few) cores and torch's own intra-op pool stays the only pool.
_COMPUTE_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ravnest-compute")


async def run_in_compute_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run a blocking (torch) function on the single compute thread without blocking the loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_COMPUTE_EXECUTOR, functools.partial(fn, *args, **kwargs))


_MAX_STRETCH = 6.0  # a wait never grows past this many times its timeout, however busy the host


_PROC_STAT = "/proc/stat"


def _run_queue() -> int:
    """Tasks runnable right now besides this one (Linux `/proc/stat`; 0 where it cannot be read)."""
    try:
        with open(_PROC_STAT, encoding="ascii") as stat:
            for line in stat:
                if line.startswith("procs_running "):
                    return max(0, int(line.split()[1]) - 1)
    except (OSError, ValueError):
        pass
    return 0


def load_stretch() -> float:
    """How many times slower than an idle host this one runs now: the load per CPU this process may use,
    between 1 and `_MAX_STRETCH` (1 where the platform has no load average). The load is the larger of
    the 1-minute load average and the tasks runnable right now: the average lags a minute behind a host
    that just got busy (a test suite's first seconds), the run queue does not."""
    try:
        load = max(os.getloadavg()[0], float(_run_queue()))
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 1.0
    return min(_MAX_STRETCH, max(1.0, load / max(cpus, 1)))


class StretchedDeadline:
    """A deadline that grows with the host's load (`load_stretch`), for waits on work that needs CPU.

    A peer that starts in 5 s on an idle host took over 60 s at a load of 30 on 2 cores; a fixed deadline
    tuned to a quiet machine then fails a healthy wait. The deadline is `timeout_s` times the largest
    stretch seen while waiting (checked once `timeout_s` has passed), never more than `_MAX_STRETCH` times.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.stretch = load_stretch()

    def expired(self) -> bool:
        elapsed = time.monotonic() - self.started
        if elapsed < self.timeout_s:
            return False
        self.stretch = max(self.stretch, load_stretch())
        return elapsed >= self.timeout_s * self.stretch

    def describe(self) -> str:
        """The wait's length for an error message, e.g. ``60s (x3.2 for the host's load)``."""
        waited = time.monotonic() - self.started
        return f"{waited:.0f}s" + (
            f" ({self.timeout_s:.0f}s x{self.stretch:.1f} for the host's load)" if self.stretch > 1 else ""
        )


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout_s: float,
    *,
    interval_s: float = 0.05,
    message: str = "condition",
) -> None:
    """Poll `predicate` until it holds; TimeoutError naming `message` after `timeout_s`, stretched by the
    host's load (`StretchedDeadline`)."""
    deadline = StretchedDeadline(timeout_s)
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if deadline.expired():
            raise TimeoutError(f"timed out after {deadline.describe()} waiting for {message}")
        await asyncio.sleep(interval_s)


class TaskOwner:
    """Owns background tasks: names them, logs their crashes, cancels and awaits them on `aclose()`.

    Unlike `asyncio.TaskGroup`, one crashed background loop does not cancel its siblings: a peer keeps
    announcing even if its prober died, and says so in the log.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self._name} is closed; cannot start {name}")
        task = asyncio.create_task(coro, name=f"{self._name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task %s crashed", task.get_name(), exc_info=task.exception())

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    async def aclose(self, timeout_s: float = 10.0) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout_s)
