"""`IstRunner`: this peer's part of an IST job over the network — a worker that also holds model entries.

Round r on worker w (no coordinator: every worker derives round r's deal from (job seed, r) and the
deaths it knows, `training.ist_state`):
1. pull: from every other live worker, the entries of w's round-r sub-network that worker holds (it
   trained them in an earlier round), and its shared tensors (`ist_pull`, one request per holder, all at
   once); the shared tensors (head bias, BatchNorm counters) are averaged over the live workers;
2. train the sub-network for the job's `ist.local_steps` on w's own batches (the compute thread);
3. commit: write the sub-network into the replica; w now holds those entries and serves them to the
   workers that need them in round r + 1.
After the last round every worker gathers the whole model the same way (the final pull), evaluates it on
the held-out split and publishes done metrics (mode ``ist``).

Nothing blocks past a deadline: a holder unreachable for `ist.peer_timeout_s` (or still behind after
`ist.round_timeout_s`), or whose reply is malformed, is gone for this round (its entries come from their
previous holder: its part keeps the previous values) and dead from the next round on (the next deal
excludes it). Traffic: a worker receives about its sub-network per round (`ist.ist_bytes_per_worker`),
counted on the wire by the endpoint (`RpcEndpoint.bytes_received["ist_pull"]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ravnest_p2p.discovery import RunDHT, dht_time
from ravnest_p2p.errors import InvalidMessage, RavnestError, RemoteError, TransportError
from ravnest_p2p.models import build_model, get_model_spec, make_loss, parse_config
from ravnest_p2p.runtime.optim import build_optimizer, lr_factor
from ravnest_p2p.strategies.ist import IstDeal, ScaleRule, extract_subnetwork
from ravnest_p2p.strategies.ist_blocks import shared_mean
from ravnest_p2p.strategies.ist_local import eval_layers
from ravnest_p2p.training.ist_state import IstState, LeftJob
from ravnest_p2p.training.ist_wire import IST_PULL, IstPull, PartsKind, check_parts
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.progress import ProgressStore
from ravnest_p2p.training.resume import HeldState
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.stages import load_dataset
from ravnest_p2p.training.sync_report import evaluate, ist_timing_record, store_metrics
from ravnest_p2p.training.sync_shard import SyncBatches, sync_final_step
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import TaskOwner, run_in_compute_thread

__all__ = ["IstRunner"]

logger = logging.getLogger(__name__)

_WAIT_S = 5.0  # a holder holds a pull at most this long waiting for its previous round
_RETRY_S = 0.2  # between attempts at an unreachable holder, bounded by `peer_timeout_s`
_FINAL_METRICS_S = 30.0  # a final metrics record is retried this long
_LINGER_S = 30.0  # after the final gather, serve the others' final pulls at most this long
_OK, _GONE, _MISMATCH = "ok", "gone", "mismatch"


class IstRunner:
    """Runs one peer's worker part of an IST job (see module docstring).

    Args:
        rpc: the peer's endpoint.
        dht: where metrics go (None: nowhere).
        job: the job (its `ist` section; the model must be `wide_mlp`-shaped).
        role: this peer's role: its workers are the assignment's one-stage clusters, in order.
        metrics_period_s: how often metrics are published.
        on_metrics: called with every metrics record.
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        dht: RunDHT | ProgressStore | None,
        job: JobSpec,
        role: StageRole,
        *,
        metrics_period_s: float = 2.0,
        on_metrics: Callable[[StageMetrics], None] | None = None,
    ) -> None:
        self.rpc, self.dht, self.job, self.role = rpc, dht, job, role
        self.metrics_period_s, self.on_metrics = metrics_period_s, on_metrics
        self.stop_requested = asyncio.Event()
        self.held_state: HeldState | None = None  # no hand-over of an IST job's state
        self.workers = tuple(dict.fromkeys(s.peer_id for cluster in role.assignment for s in cluster))
        self.index = self.workers.index(rpc.peer_id)
        layers = build_model(job.model, job.model_params, seed=job.seed)
        if (role.first_layer, role.end_layer, role.num_stages) != (0, len(layers), 1):
            raise ValueError(f"ist: a worker holds the whole model (layers 0-{len(layers)}), in one stage")
        self.train_set, self.held_out = load_dataset(job)
        self.batches = SyncBatches(
            self.train_set, batch_size=job.batch_size, seed=job.seed, num_workers=len(self.workers)
        )
        self.steps = sync_final_step(
            len(self.train_set),
            batch_size=job.batch_size,
            num_workers=len(self.workers),
            num_epochs=job.num_epochs,
            max_steps=job.max_steps,
        )
        self.config = job.ist
        self.num_rounds = math.ceil(self.steps / self.config.local_steps)
        self.state = IstState(
            job.job_id, self.workers, self.index, layers, seed=job.seed, num_rounds=self.num_rounds
        )
        self.scale_rule = ScaleRule(self.config.scale_rule)
        self.loss_fn = make_loss(get_model_spec(job.model).loss(parse_config(job.model, job.model_params)))
        self.round = 0
        self.loss: float | None = None
        self.round_log: list[dict[str, Any]] = []  # per round: live, gone, bytes pulled, seconds
        self.compute_s = 0.0
        self.final_pull_s = 0.0
        self.eval_loss: float | None = None
        self.eval_accuracy: float | None = None
        self._done = False
        self._failure: str | None = None
        self.left: str | None = None  # why the others excluded this worker (it stopped, the job goes on)
        self._started = time.monotonic()
        self._tasks = TaskOwner(f"ist-{rpc.peer_id[-6:]}")

    # ----- the run ----------------------------------------------------------------------------------
    async def run(self) -> StageMetrics:
        """Train every round, gather the model, evaluate it (or fail); return the final metrics."""
        cancelled = False
        await self.rpc.serve(IST_PULL, self.state.handle_pull)
        self._tasks.spawn(self._metrics_loop(), name="metrics")
        try:
            self._started = time.monotonic()
            for round_index in range(self.num_rounds):
                if self.stop_requested.is_set():
                    break
                await self._round(round_index)
            gathering = time.monotonic()
            await self._pull(self.num_rounds, final=True)
            self.final_pull_s = time.monotonic() - gathering
            self.eval_loss, self.eval_accuracy = await run_in_compute_thread(self._evaluate)
            logger.info(
                "job %s: IST worker %d done after %d rounds: held-out loss %.4f accuracy %.4f",
                self.job.job_id,
                self.index,
                self.round,
                self.eval_loss,
                self.eval_accuracy,
            )
            logger.info("ist timing %s", json.dumps(ist_timing_record(self)))
            self._done = True
            await self._linger()
        except LeftJob as exc:  # excluded by the others, who go on: not a failure of the job
            logger.warning("job %s: %s", self.job.job_id, exc)
            self.left = str(exc)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await self._tasks.aclose()
            with contextlib.suppress(Exception):
                await self.rpc.unserve(IST_PULL)
            if not cancelled:
                await self.publish_metrics(final=True)
        return self.metrics()

    async def _round(self, round_index: int) -> None:
        began = time.monotonic()
        received = self.rpc.bytes_received[IST_PULL.name]
        live, gone = await self._pull(round_index, final=False)
        pulled = self.rpc.bytes_received[IST_PULL.name] - received
        deal = self.state.deal(round_index, live)
        computing = time.monotonic()
        pull_s = computing - began
        sub, loss = await run_in_compute_thread(self._train, round_index, deal, live.index(self.index))
        self.compute_s += time.monotonic() - computing
        if self.state.live(round_index) != live:
            raise RavnestError(f"round {round_index}: the deal changed while training ({live})")
        self.state.commit(round_index, live, deal, sub)
        await self.state.notify()
        self.round, self.loss = round_index + 1, loss
        logger.info(
            "job %s: IST round %d committed (%d workers, %d gone, %d bytes pulled, loss %s)",
            self.job.job_id,
            round_index,
            len(live),
            len(gone),
            pulled,
            f"{loss:.4f}" if loss is not None else "-",
        )
        self.round_log.append(
            {
                "round": round_index,
                "live": list(live),
                "gone": sorted(gone),
                "bytes_pulled": pulled,
                "seconds": time.monotonic() - began,
                "pull_seconds": pull_s,
                "loss": loss,
            }
        )

    # ----- the pull phase ---------------------------------------------------------------------------
    async def _pull(self, round_index: int, *, final: bool) -> tuple[tuple[int, ...], set[int]]:
        """Fetch this round's entries and shared tensors from every live holder; (deal, gone) used."""
        while True:
            if self.state.evicted is not None:
                raise LeftJob(f"worker {self.index} left the job: {self.state.evicted}")
            live = self.state.live(round_index)
            if self.index not in live:
                raise RavnestError(f"worker {self.index} is not dealt round {round_index}")
            gone = self.state.gone()
            while True:
                holders = [w for w in live if w != self.index and w not in gone]
                indices, masks = self.state.masks(
                    round_index, live, sorted(gone), self.index, holders, final=final
                )
                results = await asyncio.gather(
                    *(self._pull_from(w, round_index, live, gone, masks[w], final) for w in holders)
                )
                lost = [w for w, (kind, _) in zip(holders, results, strict=True) if kind == _GONE]
                if lost:
                    logger.warning("job %s round %d: workers %s are gone", self.job.job_id, round_index, lost)
                    self.state.learn(lost, [round_index + 1] * len(lost))
                    gone |= set(lost)
                    continue  # their holdings now come from other holders: pull again
                break
            if any(kind == _MISMATCH for kind, _ in results) or self.state.live(round_index) != live:
                continue  # the deal changed: pull again under the new one
            self._install(round_index, holders, indices, masks, [parts for _, parts in results])
            return live, gone

    async def _pull_from(
        self,
        worker: int,
        round_index: int,
        live: tuple[int, ...],
        gone: set[int],
        masks: list[Tensor],
        final: bool,
    ) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.round_timeout_s
        patience = self.config.round_timeout_s if round_index == 0 else self.config.peer_timeout_s
        failing_since: float | None = None
        peer = self.workers[worker]
        while True:
            dead_workers, dead_since = self.state.deaths()
            request = IstPull(
                job_id=self.job.job_id,
                round=round_index,
                final=final,
                live=live,
                gone=tuple(sorted(gone)),
                dead_workers=dead_workers,
                dead_since=dead_since,
                wait_s=min(_WAIT_S, max(0.0, deadline - loop.time())),
            )
            try:
                reply = await self.rpc.call(peer, IST_PULL, request, timeout_s=request.wait_s + 30.0)
            except (RemoteError, TransportError) as exc:
                if isinstance(exc, RemoteError) and "declared dead" in str(exc):
                    raise LeftJob(f"worker {self.index} left the job: {exc}") from None
                now = loop.time()
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since >= patience or now >= deadline:
                    logger.info("job %s: worker %d unreachable: %r", self.job.job_id, worker, exc)
                    return _GONE, None
                await asyncio.sleep(_RETRY_S)  # retry backoff, bounded by the deadlines above
                continue
            failing_since = None
            message = reply.message
            if self.state.learn(message.dead_workers, message.dead_since):
                await self.state.notify()
            if message.kind == PartsKind.MISMATCH:
                return _MISMATCH, None
            if message.kind == PartsKind.PENDING:
                if loop.time() >= deadline:
                    logger.info(
                        "job %s: worker %d too slow for round %d", self.job.job_id, worker, round_index
                    )
                    return _GONE, None
                continue
            try:
                parts = check_parts(
                    message,
                    reply.tensors,
                    round_index=round_index,
                    counts=[int(m.sum()) for m in masks],
                    dealt_dtypes=[t.dtype for t in self.state.tensors.dealt],
                    shared=self.state.tensors.shared,
                )
            except InvalidMessage as exc:
                logger.warning("job %s: refused worker %d's parts: %s", self.job.job_id, worker, exc)
                return _GONE, None
            return _OK, parts

    def _install(
        self,
        round_index: int,
        holders: Sequence[int],
        indices: list[Tensor],
        masks: dict[int, list[Tensor]],
        parts: Sequence[tuple[list[Tensor], list[Tensor]]],
    ) -> None:
        """Write the pulled entries into the replica; average the shared tensors over the live workers."""
        state = self.state
        shared_by = {self.index: state.shared[round_index - 1]}
        with torch.no_grad():
            for worker, (dealt, shared) in zip(holders, parts, strict=True):
                for full, index, mask, values in zip(
                    state.tensors.dealt, indices, masks[worker], dealt, strict=True
                ):
                    full.view(-1)[index[mask]] = values
                shared_by[worker] = shared
            for k, full in enumerate(state.tensors.shared):
                full.copy_(shared_mean([shared_by[w][k] for w in sorted(shared_by)]))

    # ----- compute (the compute thread) -------------------------------------------------------------
    def _train(self, round_index: int, deal: IstDeal, position: int) -> tuple[list[nn.Module], float | None]:
        sub = extract_subnetwork(self.state.layers, deal, position, scale_rule=self.scale_rule)
        model = nn.Sequential(*sub).train()
        optimizer, _ = build_optimizer(model.parameters(), self.job.optimizer)
        losses = []
        first = round_index * self.config.local_steps
        for step in range(first, min(self.steps, first + self.config.local_steps)):
            for group in optimizer.param_groups:
                group["lr"] = self.job.optimizer.lr * lr_factor(step, self.job.optimizer)
            inputs, labels = self.batches.batch(step, self.index)
            optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(model(inputs), labels)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return sub, (sum(losses) / len(losses) if losses else None)

    def final_model(self) -> nn.Module:
        """The gathered full model as it is evaluated (the scaling rule applied)."""
        n = len(self.state.live(max(0, self.num_rounds - 1)))
        return nn.Sequential(*eval_layers(self.state.layers, n, self.scale_rule))

    def _evaluate(self) -> tuple[float, float]:
        return evaluate(self.final_model(), self.held_out, self.loss_fn, self.job.eval_batch_size)

    async def _linger(self) -> None:
        """Serve the other live workers' final pulls (bounded by `_LINGER_S`)."""
        state = self.state
        others = {w for w in state.live(self.num_rounds) if w != self.index}

        def served() -> bool:
            return others - state.gone() <= state.final_served or self.stop_requested.is_set()

        await state.wait_for(served, _LINGER_S)

    # ----- reporting --------------------------------------------------------------------------------
    def metrics(self) -> StageMetrics:
        wall_s = time.monotonic() - self._started
        steps = min(self.steps, self.round * self.config.local_steps)
        return StageMetrics(
            mode="ist",
            epoch=self.role.epoch,
            job_id=self.job.job_id,
            peer_id=self.rpc.peer_id,
            cluster=self.index,
            stage=0,
            num_stages=1,
            step=steps,
            optimizer_steps=steps,
            loss=self.loss if self.loss is not None and self.loss < 1e9 else None,
            samples_per_s=min(1e12, steps * self.job.batch_size / max(wall_s, 1e-9)),
            compute_s=min(self.compute_s, 1e9),
            train_wall_s=min(wall_s, 1e9),
            eval_loss=self.eval_loss,
            eval_accuracy=self.eval_accuracy,
            done=self._done,
            failed=self._failure[:500] if self._failure else None,
            updated_at=dht_time(),
        )

    async def publish_metrics(self, *, final: bool = False) -> None:
        metrics = self.metrics()
        if self.on_metrics is not None:
            self.on_metrics(metrics)
        if self.dht is not None:
            await store_metrics(self.dht, metrics, final=final, retry_for_s=_FINAL_METRICS_S)

    async def _metrics_loop(self) -> None:
        while True:
            await self.publish_metrics()
            await asyncio.sleep(self.metrics_period_s)
