"""Asyncio helpers: every task has an owner, polling has a deadline, torch runs on one thread."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["TaskOwner", "run_in_compute_thread", "wait_until"]

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Torch compute is the only thing that runs off the event loop, and it runs on this one thread so that
# stages never race each other for the (few) cores and torch's own intra-op pool stays the only pool.
_COMPUTE_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ravnest-compute")


async def run_in_compute_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run a blocking (torch) function on the single compute thread without blocking the loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_COMPUTE_EXECUTOR, functools.partial(fn, *args, **kwargs))


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout_s: float,
    *,
    interval_s: float = 0.05,
    message: str = "condition",
) -> None:
    """Poll `predicate` until it holds; raise TimeoutError naming `message` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.1f}s waiting for {message}")
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
