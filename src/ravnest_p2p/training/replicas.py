"""Averaging a stage with the same parameters in the other clusters, overlapped with training.

Every stage owner of every cluster derives the same shard map from the job's assignment (parameters
keyed by global name, cut at every cluster's stage boundaries) and joins the rings of the shards it owns.
Rounds are paired by index: round r comes due on each replica when it finishes step
r x `averaging_period_steps` — or, with `averaging_period_s`, at r x period seconds of the epoch clock
on every replica, which keeps clusters of different speeds pairing up (by step, a faster cluster drifts
ahead until its partners arrive after the deadline and every round runs alone; seen on the lab). A round
runs in the background (delayed averaging: the average of the snapshot, plus what the stage learned
meanwhile). A round that comes due while the previous one runs starts when that one ends, under the
next index; replicas that fall out of phase meet again under a wall-clock index (the rule, and why:
`training/round_schedule.py`).

At the last step every stage runs one more round synchronously, holding its pipeline work, so the
replicas end training with identical weights (and evaluation sees them).

With the job's `outer_optimizer`, every periodic round is an outer-optimizer sync instead
(`averaging/outer.py`: averaged pseudo-gradients, an outer Nesterov step on a shared anchor); the
schedule, rings and delayed apply are the same; the closing round is coded under a Δ codec where the
replicas' anchors agree (`averaging/outer_averager.py`). Its state
can move with the stage (`export_outer_state` / `import_outer_state`). With its `num_fragments` > 1
(by step only) the syncs are staggered (`averaging/stagger.py`, Streaming DiLoCo): one fragment of the
rings starts a sync every H / num_fragments steps, in the background; fragments' syncs may overlap, a
fragment whose previous sync still runs skips its turn (its Δ goes into its next sync).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping

import torch

from ravnest_p2p.averaging import (
    Averager,
    AveragerConfig,
    OuterAverager,
    OuterOptimizer,
    OuterOptimizerConfig,
    RingAllReduce,
    RingConfig,
    RoundMetrics,
    ShardMap,
    build_shard_map,
    wait_for_period_boundary,
)
from ravnest_p2p.averaging.session import LinkRates
from ravnest_p2p.averaging.stagger import due_fragment, fragment_rings
from ravnest_p2p.models import build_layers
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.round_schedule import RESYNC_S, RESYNC_SLOTS, RoundSchedule
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import TaskOwner
from ravnest_p2p.utils.aio import run_in_compute_thread

__all__ = [
    "FINAL_ROUND",
    "ReplicaAverager",
    "shard_map_for",
    "stage_entries",
    "tensor_digests",
]

logger = logging.getLogger(__name__)

# The closing round's index: above any periodic round, the same on every replica.
FINAL_ROUND = 2**40


def stage_entries(job: JobSpec, first_layer: int, end_layer: int) -> list[tuple[str, int]]:
    """(global name, numel) of the floating parameters and buffers of layers [first_layer, end_layer)."""
    layers = build_layers(job.model, job.model_params, seed=None, start=first_layer, end=end_layer)
    entries = []
    for index, layer in enumerate(layers, start=first_layer):
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
            if tensor.is_floating_point():
                entries.append((f"{index}.{name}", tensor.numel()))
    return entries


def tensor_digests(named: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """A short digest (64 bits of sha256 of the bytes) of every floating tensor, by name.

    Replicas right after a round compare equal exactly when their averaged tensors are bit-identical,
    which the ring guarantees (every member ends with the reduced chunk its owner computed).
    """
    out = {}
    for name, tensor in sorted(named.items()):
        if tensor.is_floating_point():
            # hashed in place: `tobytes` copied each tensor (up to 16 MiB for a 350m block) while a
            # finished stage, at its peak, published its final metrics
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            out[name] = hashlib.sha256(memoryview(data)).hexdigest()[:16]  # type: ignore[arg-type]
    return out


def shard_map_for(job: JobSpec, *, epoch: int) -> ShardMap | None:
    """The shard map of the job's explicit assignment, or None with fewer than two clusters."""
    clusters = job.assignment or ()
    if len(clusters) < 2:
        return None
    return build_shard_map(
        [
            [(s.peer_id, stage_entries(job, s.first_layer, s.end_layer)) for s in stages]
            for stages in clusters
        ],
        epoch=epoch,
    )


class ReplicaAverager:
    """Owns this stage's rings and rounds; plug `on_step` into `StageService.on_step`."""

    def __init__(
        self,
        rpc: RpcEndpoint,
        executor: StageExecutor,
        shard_map: ShardMap,
        *,
        period_steps: int,
        final_step: int,
        period_s: float = 0.0,
        config: RingConfig | None = None,
        outer: OuterOptimizerConfig | None = None,
        link_rates: LinkRates | None = None,
    ) -> None:
        self.rings = RingAllReduce(rpc, config or RingConfig())
        self.executor = executor
        self.shard_map = shard_map
        self.period_steps = 0 if period_s > 0 else period_steps
        self.period_s = period_s
        self.final_step = final_step
        # rounds are started here (`on_step`), not by the averager's own loop; its period is unused
        schedule = AveragerConfig(period_steps=max(period_steps, 1))
        read = lambda: {**executor.parameters_by_name(), **executor.buffers_by_name()}  # noqa: E731
        self.outer = None if outer is None else OuterOptimizer(outer, plain=executor.buffers_by_name())
        # every ring member's rates, the same figures at every member (the agreed plan's, bytes/s): chunk
        # sizes (`averaging/weights.py`) and the Δ codec per ring (`averaging/codec_choice.py`)
        self.link_rates = link_rates
        rates = lambda: self.link_rates  # noqa: E731
        self.averager = (
            Averager(
                schedule,
                self.rings,
                read=read,
                write=executor.assign_parameters,
                shard_map=lambda: self.shard_map,
                link_rates=rates,
            )
            if self.outer is None
            else OuterAverager(
                schedule,
                self.rings,
                outer=self.outer,
                read=read,
                write=executor.assign_parameters,
                shard_map=lambda: self.shard_map,
                link_rates=rates,
            )
        )
        self._round: asyncio.Task[RoundMetrics | None] | None = None
        self._tasks = TaskOwner("replica-averager")
        self.rounds: list[RoundMetrics] = []
        self.skipped = 0  # staggered syncs skipped (a fragment's previous sync still ran)
        self.schedule = RoundSchedule()
        self.final_done = False
        # staggered syncs (`averaging/stagger.py`): by step only; one background sync per fragment
        self.num_fragments = outer.num_fragments if outer is not None and self.period_steps else 1
        self._fragment_rings = fragment_rings(shard_map, self.num_fragments)
        self._fragment_tasks: dict[int, asyncio.Task[RoundMetrics | None]] = {}

    def rebase(self, shard_map: ShardMap, *, final_step: int, link_rates: LinkRates | None = None) -> None:
        """Average with the rings of a new plan's `shard_map` from the next round on (the stage kept its
        place in the new plan: `training.continuity`); a round under way finishes on the old rings."""
        self.shard_map = shard_map
        self.link_rates = link_rates  # the new plan's (a round under way keeps the rates it started with)
        self.final_step = final_step
        self._fragment_rings = fragment_rings(shard_map, self.num_fragments)  # the new map's ring ids
        self.schedule.new_epoch()
        self.rings.expect(shard_map)

    async def start(self) -> None:
        # before the first round: only this map's ring members may open early streams to us
        self.rings.expect(self.shard_map)
        if self.outer is not None:  # the anchor: the weights training starts from (or imported ones)
            # buffers too: with a Δ codec they travel as anchor - value (`averaging/outer.py`), and the
            # anchor must be the same at every replica (the start, built from the job's seed)
            executor = self.executor
            held = lambda: {**executor.parameters_by_name(), **executor.buffers_by_name()}  # noqa: E731
            await run_in_compute_thread(lambda: self.outer.initialise(held()))  # type: ignore[union-attr]
        await self.rings.start()
        if self.period_s > 0:
            self._tasks.spawn(self._clock(), name="clock")

    async def _clock(self) -> None:
        """Start round floor(time / period) at every period boundary (the same index on every replica)."""
        while not self.final_done:
            index = await wait_for_period_boundary(self.period_s)
            if not self.final_done:
                self._start_round(index)

    def _start_round(self, period_index: int) -> None:
        """Period `period_index` came due: start its round, or defer it (`RoundSchedule`)."""
        busy = self._round is not None and not self._round.done()
        index = self.schedule.due(period_index, busy=busy)
        if busy:
            logger.info("averaging round of period %d deferred: the previous one runs", period_index)
        elif index is not None:
            self._round = self._tasks.spawn(self._rounds_from(index), name="round")

    async def _rounds_from(self, round_index: int) -> RoundMetrics | None:
        """Run `round_index`, then the next one if one came due meanwhile, until none did."""
        metrics: RoundMetrics | None = None
        index: int | None = round_index
        while index is not None and not self.final_done:
            metrics = await self._run(index)
            index = self.schedule.finished(
                complete=not self._short_rings(metrics), resync_index=self._resync_index()
            )
        return metrics

    def _resync_index(self) -> int:
        """The round index out of phase (`RoundSchedule`): the wall clock's, the same at every replica."""
        now = time.time()
        return int(now // self.period_s) if self.period_s > 0 else int(now // RESYNC_S) * RESYNC_SLOTS

    def _start_fragment(self, round_index: int, fragment: int) -> None:
        """Start `fragment`'s sync in the background, unless its previous one still runs (skipped).

        Fragments' syncs overlap each other (disjoint rings and names); a fragment's own syncs do not.
        A skipped sync is a sync this replica misses: its partners' ring forms without it, and its Δ
        goes into its next sync of that fragment (`averaging/outer.py`'s rule).
        """
        running = self._fragment_tasks.get(fragment)
        if running is not None and not running.done():
            self.skipped += 1
            logger.info("sync %d of fragment %d skipped: its previous sync still runs", round_index, fragment)
            return
        rings = self._fragment_rings[fragment]
        self._fragment_tasks[fragment] = self._tasks.spawn(
            self._run(round_index, ring_ids=rings), name=f"fragment-{fragment}"
        )

    async def _run(self, round_index: int, *, ring_ids: frozenset[str] | None = None) -> RoundMetrics | None:
        epoch, num_replicas = self.shard_map.epoch, len(self.shard_map.shards[0].owners)
        logger.info("epoch %d: averaging round %d started", epoch, round_index)
        # the closing round waits for replicas that have not finished yet: after it, they all agree
        metrics = await self.averager.run_round(
            round_index, wait_for_all=round_index == FINAL_ROUND, ring_ids=ring_ids
        )
        if metrics is not None:
            self.rounds.append(metrics)
            logger.info(
                "epoch %d: averaging round %d finished in %.2fs with %s of %d replicas",
                epoch,
                round_index,
                metrics.time_s,
                self.last_round_participants,
                num_replicas,
            )
        return metrics

    async def on_step(self, step: int) -> None:
        if step >= self.final_step and not self.final_done:
            self.final_done = True
            for running in [self._round, *self._fragment_tasks.values()]:
                if running is not None:
                    with contextlib.suppress(Exception):
                        await running  # never two rounds' snapshots interleaved
            await self._run(FINAL_ROUND)
            return
        if self.period_steps and self.num_fragments > 1:
            due = due_fragment(step, self.period_steps, self.num_fragments)
            if due is not None:
                self._start_fragment(*due)
        elif self.period_steps and step % self.period_steps == 0:
            self._start_round(step // self.period_steps)

    def _short_rings(self, metrics: RoundMetrics | None) -> frozenset[str]:
        """The rings of `metrics` that averaged without some member of the ring."""
        if metrics is None:
            return frozenset()
        sizes = {s.ring_id: len(s.ring) for s in self.shard_map.shards}
        return frozenset(r.ring_id for r in metrics.rings if len(r.participants) < sizes.get(r.ring_id, 0))

    @property
    def last_round_participants(self) -> int | None:
        """Fewest members in the average of any of this stage's rings in the last completed round."""
        if not self.rounds or not self.rounds[-1].rings:
            return None
        return min(len(r.participants) for r in self.rounds[-1].rings)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.rounds)

    def export_outer_state(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The outer optimizer's state by ``outer/<name>/<slot>`` (empty without one), for a re-plan.

        `copy` False: the live tensors (`stage_state.live_tensors`, whose readers copy or check versions:
        every sync also writes the parameters, so a hand-over notices it).
        """
        return {} if self.outer is None else self.outer.export_state(copy=copy)

    def import_outer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take outer state exported by this layer range's previous owner(s); call before `start`.

        Raises:
            ValueError: no outer optimizer, or an entry does not fit (nothing changed).
        """
        if self.outer is None:
            raise ValueError("this job has no outer optimizer")
        held = {**self.executor.parameters_by_name(), **self.executor.buffers_by_name()}
        shapes = {n: p.shape for n, p in held.items()}
        self.outer.import_state(tensors, shapes=shapes)

    async def aclose(self) -> None:
        await self._tasks.aclose()
        await self.rings.aclose()
