"""Foreground before background on one peer's links: pipeline messages first, averaging parts yield.

Problem. A peer's pipeline sends (activations, gradients) and its averaging ring's parts leave through
the same uplink. Both ride TCP flows, and TCP shares a bottleneck fairly among flows, so while a ring
round runs, the pipeline gets about half of a link it needed more of, and its messages queue behind
megabytes of parameters. The pipeline is the foreground (a late activation stalls every stage after
it); averaging is delayed anyway (it is applied a round late), so it can use what the pipeline leaves.

Design. One `TrafficGate` per peer (it lives on the transport, so the RPC endpoint and the averaging
streams of a peer share it). Foreground sends mark themselves in progress (`with gate.foreground()`),
from the first byte until the receiver answered. A background writer calls
`await gate.background_turn(busy_s)` before each part: it returns at once when no foreground send is
in progress, else when the last one ends, but never later than its budget: the time the writer's
previous part kept the link busy (`busy_s`) times (1 - `min_share`) / `min_share`, capped at
`max_yield_s`. So averaging gets all the time the pipeline leaves idle and, while the pipeline never
pauses, still about `min_share` of the link's time: slowed, never starved, each wait short against the
ring's step deadlines. The budget scales with the measured part time, so the share does not depend on
the part size or the link rate, which the gate does not know.

A gate cannot preempt bytes already handed to the daemon, the kernel or a router's queue, so while the
foreground is busy (`foreground_recent`) the writer also keeps at most `window_bytes` of parts (at least
one part) unacknowledged: the ring's per-part acks clock it, which bounds what a pipeline message can
find queued ahead of it, on the sender's uplink and on the receiver's downlink. Part size is therefore
the preemption granularity: smaller parts, finer priority.

Rejected. Marking packets (DSCP, SO_PRIORITY): the bytes leave through p2pd's sockets, which we do not
own, and home routers ignore the marks. A fixed rate cap on averaging: needs the link rate and wastes
the link whenever the pipeline idles. A fixed longest wait per part: the share then depends on part size
and link rate (measured: with 1 MiB parts at 25 Mbit/s, a 0.25 s cap left averaging most of the link,
because a pipeline with several sends in flight is almost never idle at a part boundary). Defaults:
min_share 0.5 with 256 KiB ring parts (25 Mbit/s, 2x2 lab: 1.02-1.08 of no-averaging samples/s while
averaging got ~4 Mbit/s per peer; with min_share 0.25, 1.09-1.11 but ~2.6 Mbit/s). LEDBAT-style
backoff on queueing delay (uTP, RFC 6817): the right tool for the receiver's downlink, which this gate
does not see, but it needs per-part one-way delay samples the ring protocol does not carry.

Limits. Only this peer's own sends are seen: a neighbour's averaging parts can still queue on this
peer's downlink ahead of a gradient arriving from another peer (the window bounds how many). A
foreground call counts as in progress until its reply, which includes the receiver's handler time. The
gate is per event loop and not thread-safe, like the rest of the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["GateConfig", "GateStats", "TrafficGate"]


class GateConfig(BaseModel):
    """How long background traffic yields, and how much of it may be in flight while it does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_share: float = Field(default=0.5, gt=0, le=1)  # background's time share while foreground is busy
    max_yield_s: float = Field(default=2.0, ge=0)  # a background part waits at most this long
    recent_s: float = Field(default=1.0, ge=0)  # foreground this recent keeps background's window small
    window_bytes: int = Field(default=256 << 10, ge=0)  # background bytes unacknowledged meanwhile


@dataclass
class GateStats:
    """What the gate did so far (for logs and benchmarks)."""

    foreground_sends: int = 0
    background_turns: int = 0
    yielded_turns: int = 0  # turns that waited for a foreground send to end
    forced_turns: int = 0  # turns that stopped waiting after `max_yield_s`
    yielded_s: float = 0.0


class TrafficGate:
    """Per-peer priority between foreground sends and background writers (see the module docstring)."""

    def __init__(
        self, config: GateConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or GateConfig()
        self.stats = GateStats()
        self._clock = clock
        self._active = 0
        self._last_foreground = -math.inf
        # plain futures, not an asyncio.Event: the gate is built outside any loop and outlives test loops
        self._idle_waiters: set[asyncio.Future[None]] = set()

    @property
    def foreground_active(self) -> bool:
        return self._active > 0

    def foreground_recent(self) -> bool:
        """A foreground send is in progress or ended less than `config.recent_s` ago."""
        return self._active > 0 or self._clock() - self._last_foreground < self.config.recent_s

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Mark a foreground send in progress for the duration of the block (nests, survives errors)."""
        self._active += 1
        self.stats.foreground_sends += 1
        try:
            yield
        finally:
            self._active -= 1
            self._last_foreground = self._clock()
            if self._active == 0:
                for waiter in self._idle_waiters:
                    if not waiter.done():
                        waiter.set_result(None)
                self._idle_waiters.clear()

    def yield_budget_s(self, busy_s: float) -> float:
        """How long a background part may wait, after the previous one kept the link busy `busy_s`."""
        share = self.config.min_share
        return min(self.config.max_yield_s, max(busy_s, 0.0) * (1 - share) / share)

    async def background_turn(self, busy_s: float) -> None:
        """Wait until no foreground send is in progress, at most `yield_budget_s(busy_s)`.

        Args:
            busy_s: how long this writer's previous part kept the link busy (0 for a first part).

        Cancellation-safe: a cancelled wait leaves nothing behind.
        """
        self.stats.background_turns += 1
        if self._active == 0:
            return
        started = self._clock()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.add(waiter)
        try:
            async with asyncio.timeout(self.yield_budget_s(busy_s)):
                await waiter
            self.stats.yielded_turns += 1
        except TimeoutError:
            self.stats.forced_turns += 1  # the share floor: background goes even though foreground is busy
        finally:
            self._idle_waiters.discard(waiter)
            self.stats.yielded_s += self._clock() - started

    def background_window_parts(self, part_size_bytes: int) -> int | None:
        """How many background parts may be unacknowledged now: None (no limit) while the foreground is
        quiet, else `config.window_bytes` worth, but at least one part."""
        if not self.foreground_recent():
            return None
        return max(1, self.config.window_bytes // max(part_size_bytes, 1))
