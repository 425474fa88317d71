"""Averaging in the background while training goes on: delayed averaging (DaSGD-style).

Problem. A ring round over slow links takes seconds to minutes; stopping the pipeline for it would waste
exactly the compute volunteers lend us. Training must continue while the average is computed.

Solution (Zhou et al., "DaSGD: Squeezing SGD Parallelization Performance in Distributed Training Using
Delayed Averaging", 2020; the same idea as hivemind's delayed parameter averaging). At round start take a
snapshot θ0 of the local parameters; average the snapshot across replicas (θ̄) while local steps keep
changing θ; when θ̄ arrives, apply θ ← θ̄ + (θ_now - θ0): the replicas' consensus plus the local progress
made meanwhile, so no local update is lost and none is counted twice. Snapshot and apply run on the
compute thread, so they never interleave with a stage's own optimizer step.

Alternatives rejected. Overwriting θ with θ̄ drops the updates made during the round (the longer the round,
the more). Blocking averaging (Ravnest's original design) idles the pipeline for a full round.

Limits. The average is one round stale when applied; with rounds much longer than the period between
changes of the learning rate this behaves like a larger effective batch, as DaSGD discusses. Rounds are
numbered by wall-clock period (`period_s`) or by local step count (`period_steps`); replicas pair up by
round number, so in step mode clusters must step at similar rates (a lagging one joins the next round and
is dropped from rounds it misses by more than the deadline). A round that comes due while one runs starts
when that one ends (the newest due round wins): skipping it let two partners lock out of phase, one
running the even rounds and the other the odd, each round alone (seen on the lab). `training/replicas.py`
does not use this loop: its rounds take indices every replica agrees on even when they outlast the
period (`training/round_schedule.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ravnest_p2p.averaging.base import RoundMetrics
from ravnest_p2p.averaging.ring import RingAllReduce
from ravnest_p2p.averaging.session import LinkRates
from ravnest_p2p.averaging.shards import ShardMap
from ravnest_p2p.utils.aio import TaskOwner, run_in_compute_thread

__all__ = ["Averager", "AveragerConfig", "delayed_average", "wait_for_period_boundary"]

logger = logging.getLogger(__name__)

ReadFn = Callable[[], Mapping[str, torch.Tensor]]
WriteFn = Callable[[Mapping[str, torch.Tensor]], None]


def delayed_average(
    averaged: Mapping[str, torch.Tensor],
    snapshot: Mapping[str, torch.Tensor],
    current: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """θ̄ + (θ_now - θ0) for every name of `averaged`, in the dtype of `current`.

    Raises:
        ValueError: a name is missing from `snapshot` or `current`, or shapes differ.
    """
    out = {}
    for name, avg in averaged.items():
        if name not in snapshot or name not in current:
            raise ValueError(f"{name!r} is missing from the snapshot or the current parameters")
        now, then = current[name], snapshot[name]
        if now.shape != avg.shape or then.shape != avg.shape:
            raise ValueError(f"{name!r}: shapes {tuple(avg.shape)}, {tuple(then.shape)}, {tuple(now.shape)}")
        delta = now.detach().to(torch.float32) - then.to(torch.float32)
        out[name] = (avg.to(torch.float32) + delta).to(now.dtype)
    return out


async def wait_for_period_boundary(period_s: float) -> int:
    """Sleep until the next multiple of `period_s` on the wall clock; return its index (time // period).

    Replicas pair rounds by these indices: the same boundary has the same index on every peer.
    """
    now = time.time()
    round_index = int(now // period_s) + 1
    await asyncio.sleep(round_index * period_s - now)
    return round_index


class AveragerConfig(BaseModel):
    """When to average. Exactly one of `period_steps` / `period_s`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    period_steps: int | None = Field(default=None, ge=1)
    period_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_period(self) -> AveragerConfig:
        if (self.period_steps is None) == (self.period_s is None):
            raise ValueError("set exactly one of period_steps and period_s")
        return self


class Averager:
    """Runs delayed-averaging rounds for one stage owner in the background.

    Args:
        config: the averaging period.
        rings: this peer's started `RingAllReduce`.
        read: returns the live tensors by global name (e.g. ``{**stage.parameters_by_name(),
            **stage.buffers_by_name()}``); called on the compute thread.
        write: applies new values by global name (e.g. ``stage.assign_parameters``); called on the
            compute thread.
        shard_map: returns the current epoch's shard map, or None while there is no plan.
        link_rates: returns every ring member's (upload, download) rate from the agreed plan, or None
            (equal chunks); see `RingAllReduce.all_reduce`.
    """

    def __init__(
        self,
        config: AveragerConfig,
        rings: RingAllReduce,
        *,
        read: ReadFn,
        write: WriteFn,
        shard_map: Callable[[], ShardMap | None],
        link_rates: Callable[[], LinkRates | None] | None = None,
    ) -> None:
        self.config = config
        self.rings = rings
        self._read = read
        self._write = write
        self._shard_map = shard_map
        self._link_rates = link_rates
        self._tasks = TaskOwner("averager")
        self._trigger: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        self._last_round = 0  # round r starts once step r * period_steps is done
        self.history: list[RoundMetrics] = []

    async def run_round(
        self, round_index: int, *, wait_for_all: bool = False, ring_ids: Collection[str] | None = None
    ) -> RoundMetrics | None:
        """Snapshot, average the snapshot with the other replicas, apply θ̄ + (θ_now - θ0).

        `wait_for_all`: wait (up to the round deadline) for ring members that have not reached the round
        yet instead of leaving them out (`RingAllReduce.all_reduce`): for the closing round.
        `ring_ids`: only these of this peer's rings (a staggered sync's fragment); None = all.

        Returns:
            The round's metrics, or None if there is no plan or nothing to average.
        """
        shard_map = self._shard_map()
        if shard_map is None:
            return None
        mine = [
            s for s in shard_map.shards_of(self.rings.peer_id) if ring_ids is None or s.ring_id in ring_ids
        ]
        names = {n for shard in mine for n in shard.names}
        if not names:
            return None
        snapshot = await run_in_compute_thread(self._snapshot, names)
        outgoing = await self._outgoing(snapshot)
        rates = None if self._link_rates is None else self._link_rates()
        averaged, metrics = await self._all_reduce(
            shard_map, outgoing, round_index, rates, wait_for_all, {s.ring_id for s in mine}
        )
        averaged_rings = {r.ring_id for r in metrics.rings if len(r.participants) > 1}
        in_average = {n for s in shard_map.shards if s.ring_id in averaged_rings for n in s.names}
        averaged = await self._incoming({n: v for n, v in averaged.items() if n in in_average})
        if averaged:
            await run_in_compute_thread(self._apply, averaged, snapshot)
        self.history.append(metrics)
        logger.info(
            "averaging round %d: %.2fs, %d B sent, %d/%d rings averaged",
            round_index,
            metrics.time_s,
            metrics.bytes_sent,
            len(averaged_rings),
            len(metrics.rings),
        )
        return metrics

    async def _all_reduce(
        self,
        shard_map: ShardMap,
        outgoing: Mapping[str, torch.Tensor],
        round_index: int,
        rates: LinkRates | None,
        wait_for_all: bool,
        ring_ids: Collection[str],
    ) -> tuple[dict[str, torch.Tensor], RoundMetrics]:
        """The rings' average of `outgoing` (`outer.py` sends encoded Δ)."""
        return await self.rings.all_reduce(
            shard_map,
            outgoing,
            round_index=round_index,
            link_rates=rates,
            wait_for_all=wait_for_all,
            ring_ids=ring_ids,
        )

    async def _outgoing(self, snapshot: dict[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """What the rings average for this snapshot (here: the snapshot; `outer.py` overrides)."""
        return snapshot

    async def _incoming(self, averaged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The values to apply as θ̄, from the rings' averages of the names that were averaged."""
        return averaged

    def _snapshot(self, names: set[str]) -> dict[str, torch.Tensor]:
        live = self._read()
        return {n: live[n].detach().clone() for n in names}

    def _apply(self, averaged: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]) -> None:
        self._write(delayed_average(averaged, snapshot, self._read()))

    # ----- the background schedule ---------------------------------------------------------------
    def notify_step(self, step: int) -> None:
        """Tell the averager the stage finished local step `step` (step mode); never blocks."""
        if self.config.period_steps is None:
            return
        round_index = step // self.config.period_steps
        if round_index > self._last_round:
            self._last_round = round_index
            if self._trigger.full():  # a newer round replaces the one still waiting
                replaced = self._trigger.get_nowait()
                logger.info("averaging round %d skipped: round %d is due", replaced, round_index)
            self._trigger.put_nowait(round_index)

    async def start(self) -> None:
        if self.config.period_s is not None:  # the first round is the next boundary's
            self._last_round = int(time.time() // self.config.period_s)
        self._tasks.spawn(self._loop(), name="rounds")

    async def aclose(self) -> None:
        await self._tasks.aclose()

    async def _next_round(self) -> int:
        if self.config.period_s is None:
            return await self._trigger.get()
        due = int(time.time() // self.config.period_s)
        if due > self._last_round:  # its boundary passed while the previous round ran: start it late
            self._last_round = due
            return due
        self._last_round = await wait_for_period_boundary(self.config.period_s)
        return self._last_round

    async def _loop(self) -> None:
        while True:
            round_index = await self._next_round()
            try:
                await self.run_round(round_index)
            except (ValueError, RuntimeError) as exc:
                logger.warning("averaging round %d failed: %r", round_index, exc)
