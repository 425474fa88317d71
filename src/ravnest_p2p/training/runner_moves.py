"""How a running `StageRunner` moves to a new plan in place (a mixin; `training.continuity` decides when).

`rebase` switches what depends on the plan epoch or the cluster index and keeps the rest running: the
pipeline's epoch (`runtime.epochs`), the replica rings and the closing round's step, the first stage's
data (the rest of its cluster's data cut for the new plan's clusters), the hand-over server's epochs
(`stage_hook.StageStateHook.rebase`), and the role that progress and metrics are keyed by.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from torch import Tensor

from ravnest_p2p.averaging import RingConfig, ShardMap
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.runtime.service import StageService
from ravnest_p2p.training.data import ArrayDataset
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.replicas import ReplicaAverager
from ravnest_p2p.training.resume import cluster_batches
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.stage_hook import StageStateHook
from ravnest_p2p.training.stage_state import StageState, attach_extra_state, outer_tensors
from ravnest_p2p.transport.rpc import RpcEndpoint

__all__ = ["InPlaceMoves"]

logger = logging.getLogger(__name__)


class InPlaceMoves:
    """The in-place half of `StageRunner` (the runner owns the state declared here)."""

    rpc: RpcEndpoint
    job: JobSpec
    role: StageRole
    service: StageService | None
    replicas: ReplicaAverager | None
    initial_state: StageState | None
    state_hook: StageStateHook | None
    _datasets: tuple[ArrayDataset, ArrayDataset] | None
    _data_base: int
    _epoch_start: int
    _taken: int
    _batches: Iterator[tuple[Tensor, Tensor]]
    _exhausted: Iterator[tuple[Tensor, Tensor]] | None
    _finishing: bool

    def _fed(self) -> int:
        raise NotImplementedError

    async def publish_metrics(self, *, final: bool = False) -> None:
        raise NotImplementedError

    def _final_optimizer_step(self, role: StageRole) -> int:
        """The optimizer step of the job's last micro-batch on `role` (the closing round comes after it)."""
        service = self.service
        assert service is not None
        if role.final_step is None:
            return 2**62
        # micro-batches this stage still has to take a backward for (in flight ones included)
        remaining = max(0, role.final_step - (self._data_base + service.stats.backwards))
        return service.executor.num_steps + remaining // self.job.update_every

    async def _start_replicas(self, shard_map: ShardMap, final_step: int) -> ReplicaAverager:
        assert self.service is not None
        job = self.job
        replicas = ReplicaAverager(
            self.rpc,
            self.service.executor,
            shard_map,
            period_steps=job.averaging_period_steps,
            period_s=job.averaging_period_s,
            final_step=final_step,
            outer=job.outer_optimizer,
            config=RingConfig(compression=job.averaging_compression),
            link_rates=self.role.plan_link_rates,  # the agreed plan's, alike at every ring member
        )
        executor = self.service.executor
        if replicas.outer is not None:
            # the outer state moves with the stage: the previous owner's, if the state came with it
            # (hand-over or checkpoint), before the averager anchors what is missing at the weights
            moved = {} if self.initial_state is None else outer_tensors(self.initial_state)
            if moved:
                try:
                    replicas.import_outer_state(moved)
                    logger.info("outer optimizer state of %d tensors taken over", len(moved))
                except ValueError as exc:
                    logger.warning("outer optimizer state not taken over: %s", exc)
            # hand-overs, snapshots and checkpoints carry it
            attach_extra_state(executor, lambda: replicas.export_outer_state(copy=False))
        await replicas.start()
        return replicas

    async def _replica_step(self, step: int) -> None:
        if self.replicas is not None:
            await self.replicas.on_step(step)

    async def rebase(self, role: StageRole) -> None:
        """Keep running on a new plan's `role`: same stage, weights and micro-batches in flight; the new
        epoch, cluster index, replica rings, data shard and last step (`training.continuity` decides when;
        the caller checks it). Counts (data position, training time) carry over."""
        service, old = self.service, self.role
        if service is None:
            raise RavnestError("the stage is not running yet: nothing to rebase")
        if self._finishing:  # its last evaluation and closing round are under way on the old plan
            raise RavnestError("the stage already ran out of data on its plan: nothing to rebase")
        service.move_to_epoch(role.epoch)
        if self.state_hook is not None:
            await self.state_hook.rebase(role.epoch, self.state_hook.allowed | role.plan_peers)
        self._epoch_start = self._fed()
        self.role = role
        final_step = self._final_optimizer_step(role)
        if self.replicas is not None and role.shard_map is not None:
            self.replicas.rebase(role.shard_map, final_step=final_step, link_rates=role.plan_link_rates)
        elif self.replicas is not None:  # no other cluster left to average with
            replicas, self.replicas = self.replicas, None
            await replicas.aclose()
        elif role.shard_map is not None:  # a second cluster appeared
            self.replicas = await self._start_replicas(role.shard_map, final_step)
        if service.is_first and self._datasets is not None:
            # the rest of this cluster's data, cut for the new plan's clusters, from where it got
            self._batches = cluster_batches(
                self.job,
                self._datasets[0],
                cluster_index=role.cluster_index,
                num_clusters=role.num_clusters,
                start=self._data_base + self._taken,
                stop=role.final_step,
            )
        logger.info(
            "stage %d of cluster %d moved in place from epoch %d to epoch %d (cluster %d of %d)",
            role.stage_index,
            old.cluster_index,
            old.epoch,
            role.epoch,
            role.cluster_index,
            role.num_clusters,
        )
        with contextlib.suppress(Exception):
            await self.publish_metrics()

    def _feed(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The first stage's micro-batches, from whichever data `rebase` last set."""
        while True:
            batches = self._batches
            batch = next(batches, None)
            if batch is None:
                if self._batches is not batches:  # `rebase` set new data meanwhile
                    continue
                self._exhausted = batches
                return
            self._taken += 1
            yield batch
