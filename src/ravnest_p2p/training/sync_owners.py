"""The owner side of synchronous SGD with backup workers on a peer: the `sync_push` / `sync_ping` handlers.

Every worker of a sync_backup job also owns the shards the layout gives it (`strategies.sync_layout`).
`OwnerService` serves them: a push carries one part per shard the sender believes we own. It is refused
whole unless the sender is a live worker of the job, every part's shard is ours under the dead set we
know (each at most once), and every part's tensors are exactly its shard's (names, shapes, dtypes,
finite): all parts are checked before any is counted. It then counts each part's gradient
(`ShardOwner`) and holds the reply until every part's step completes (at most the request's `wait_s`),
then answers with each shard's parameters (a part still open when `wait_s` runs out: pending, no
tensors). A part one step ahead still refuses the message, after the parts before it were counted
(those are well-formed gradients of the current step).

Refusals cost the sender, as in the pipeline (`transport.ledger.PeerLedger`, the pipeline's default
threshold): a malformed push (a stranger, another job, a wrong tensor, a non-finite value, a step ahead)
is counted against its sender, and past the threshold the sender's pushes are refused unread. Refusals
that are normal around a failover (not the shard's owner any more, the sender declared dead, this peer
left) are not counted.

Failover. A worker that cannot reach an owner pings it; when it stays silent for the job's
`owner_ping_timeout_s` the worker declares it dead and sends its gradient to the next owner the layout
gives. That peer verifies the claim (its own pings) before it accepts, then takes the shard over from its
own worker's copy, at the newer of its copy's step and the request's step. A step's update of that shard
can be lost if the dead owner had applied it and answered only some workers (known limit, documented in
docs/training-modes.md): a worker that got that reply pushes the next step, and the new owner
fast-forwards its copy to it rather than refuse it as ahead. With plain SGD the optimizer loses nothing
else; with momentum/Adam the new owner starts with fresh optimizer state. A peer that learns it was
declared dead (a request lists it) stops: its shards have moved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import torch

from ravnest_p2p.errors import InvalidMessage, RemoteError, TransportError
from ravnest_p2p.runtime.service import PipelineConfig
from ravnest_p2p.strategies import GradientRejected, Verdict
from ravnest_p2p.strategies.sync_layout import SyncLayout
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.sync_shard import ShardOwner
from ravnest_p2p.training.sync_wire import (
    SYNC_PING,
    SYNC_PUSH,
    PushPart,
    ReplyKind,
    ReplyPart,
    SyncPing,
    SyncPong,
    SyncPush,
    SyncReply,
    check_tensors,
    split_parts,
)
from ravnest_p2p.transport.ledger import PeerLedger
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint

__all__ = ["OwnerService"]

logger = logging.getLogger(__name__)

_PING_EACH_S = 3.0
_MISBEHAVIOUR_THRESHOLD: int = PipelineConfig.model_fields["misbehaviour_threshold"].default


class _NotCounted(InvalidMessage):
    """A refusal that is normal around a failover: not held against the sender."""


class OwnerService:
    """Serves this peer's shards of one sync_backup job (see module docstring).

    Args:
        rpc: the peer's endpoint.
        job: the job.
        layout: the job's layout.
        final_step: the job's last step.
        local_copy: (step, parameters) of a shard as this peer's worker holds it (for a takeover).
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        job: JobSpec,
        layout: SyncLayout,
        *,
        final_step: int,
        local_copy: Callable[[int], tuple[int, dict[str, torch.Tensor]]],
    ) -> None:
        self.rpc = rpc
        self.job = job
        self.layout = layout
        self.final_step = final_step
        self.local_copy = local_copy
        self.config = job.sync_backup
        self.num_required = min(self.config.num_required, len(layout.workers))
        self.dead: set[str] = set()
        self.owned: dict[int, ShardOwner] = {}
        self.evicted: str | None = None  # why this peer must stop (it was declared dead)
        self.evicted_event = asyncio.Event()
        self.final_sent: dict[int, set[str]] = {}  # shard -> workers that got its final parameters
        self.takeovers = 0
        self.taken_over: set[int] = set()  # shards this peer took over from a dead owner
        self.ledger = PeerLedger(threshold=_MISBEHAVIOUR_THRESHOLD)
        self._started = False
        self.all_final = asyncio.Event()  # every live worker got every final shard we own

    @property
    def peer_id(self) -> str:
        return self.rpc.peer_id

    async def serve(self) -> None:
        """Create the shards the initial layout gives us (at step 0), then serve them."""
        for shard in self.layout.shards_of(self.peer_id):
            self._owner_of(shard, 0)
        self._started = True
        await self.rpc.serve(SYNC_PUSH, self.handle_push)
        await self.rpc.serve(SYNC_PING, self.handle_ping)

    async def aclose(self) -> None:
        for method in (SYNC_PUSH, SYNC_PING):
            await self.rpc.unserve(method)

    # ----- liveness ---------------------------------------------------------------------------------
    async def ping(self, peer_id: str, timeout_s: float = _PING_EACH_S) -> SyncPong | None:
        """The peer's answer, or None if it gave none (unreachable, not serving the job yet, or refusing)."""
        try:
            reply = await self.rpc.call(
                peer_id, SYNC_PING, SyncPing(job_id=self.job.job_id), timeout_s=timeout_s
            )
        except (TransportError, RemoteError) as exc:
            logger.debug("sync ping of %s failed: %r", peer_id, exc)
            return None
        return reply.message

    async def confirm_dead(self, peer_id: str) -> bool:
        """Whether `peer_id` gives no answer for `owner_ping_timeout_s` (then it joins the dead set)."""
        if peer_id in self.dead:
            return True
        if peer_id == self.peer_id:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.owner_ping_timeout_s
        while loop.time() < deadline:
            pong = await self.ping(peer_id, timeout_s=min(_PING_EACH_S, max(0.1, deadline - loop.time())))
            if pong is not None and pong.in_job:
                return False
            if pong is None:
                await asyncio.sleep(0.2)  # between pings, bounded by the deadline
        if peer_id not in self.dead:
            logger.warning("job %s: worker %s gives no answer: declared dead", self.job.job_id, peer_id)
            self.dead.add(peer_id)
        return True

    async def learn_dead(self, claimed: Sequence[str]) -> None:
        """Check the workers another peer says are dead; only those we cannot reach join our dead set."""
        unknown = [p for p in claimed if p in self.layout.workers and p not in self.dead]
        if self.peer_id in unknown:
            self.evict(f"declared dead by another worker (its dead set: {list(claimed)[:4]})")
            raise _NotCounted("this peer was declared dead in the job")
        if unknown:
            await asyncio.gather(*(self.confirm_dead(p) for p in unknown))

    def evict(self, reason: str) -> None:
        if self.evicted is None:
            logger.warning("job %s: this peer leaves the job: %s", self.job.job_id, reason)
            self.evicted = reason
            self.evicted_event.set()

    def owners(self) -> tuple[str, ...]:
        return self.layout.owners(self.dead)

    # ----- handlers ---------------------------------------------------------------------------------
    async def handle_ping(
        self, request: SyncPing, tensors: list[torch.Tensor], context: CallContext
    ) -> SyncPong:
        in_job = request.job_id == self.job.job_id and self.evicted is None
        return SyncPong(in_job=in_job, peer_id=self.peer_id, dead=tuple(sorted(self.dead))[:1024])

    def _owner_of(self, shard: int, step: int) -> ShardOwner:
        owner = self.owned.get(shard)
        if owner is not None:
            return owner
        copy_step, params = self.local_copy(shard)
        start = max(copy_step, step)
        if self._started:
            self.takeovers += 1
            self.taken_over.add(shard)
            logger.info("job %s: taking shard %d over at step %d", self.job.job_id, shard, start)
        owner = self.owned[shard] = ShardOwner(
            params,
            self.layout.workers,
            self.num_required,
            self.job.optimizer,
            start_step=min(start, self.final_step),
            final_step=self.final_step,
            aggregation=self.config.aggregation,
        )
        return owner

    async def handle_push(
        self, request: SyncPush, tensors: list[torch.Tensor], context: CallContext
    ) -> tuple[SyncReply, list[torch.Tensor]]:
        """Check, count and answer one push (see module docstring); refusals count against the sender.

        Raises:
            InvalidMessage: refused (nothing changed).
        """
        sender = context.remote_peer_id
        if self.ledger.is_excluded(sender):
            raise InvalidMessage(f"{sender} is excluded from this job's shards (too many refused pushes)")
        try:
            return await self._handle_push(request, tensors, sender)
        except _NotCounted:
            raise
        except InvalidMessage as exc:
            if sender != self.peer_id:
                self.ledger.count(sender, f"sync_push: {exc}"[:200])
            raise

    async def _handle_push(
        self, request: SyncPush, tensors: list[torch.Tensor], sender: str
    ) -> tuple[SyncReply, list[torch.Tensor]]:
        if request.job_id != self.job.job_id:
            raise InvalidMessage(f"not job {request.job_id!r}")
        if sender not in self.layout.workers:
            raise InvalidMessage("the sender is not a worker of the job")
        if self.evicted is not None:
            raise _NotCounted(f"this peer left the job: {self.evicted}")
        if sender in self.dead:
            raise _NotCounted("the sender was declared dead")
        shards = [part.shard for part in request.parts]
        if len(set(shards)) != len(shards):
            raise InvalidMessage("a shard appears twice in one push")
        if any(shard >= len(self.layout.shards) for shard in shards):
            raise InvalidMessage(f"no shard {max(shards)}")
        tensors_of = split_parts([len(p.names) for p in request.parts], tensors, what="push")
        await self.learn_dead(request.dead)
        owners = self.owners()
        foreign = [shard for shard in shards if owners[shard] != self.peer_id]
        if foreign:
            raise _NotCounted(f"not the owner of shard {foreign[0]} (dead set {sorted(self.dead)[:4]})")
        checked: list[dict[str, torch.Tensor] | None] = []
        for part, part_tensors in zip(request.parts, tensors_of, strict=True):
            owner = self._owner_of(part.shard, part.step)
            if part.has_grads:
                what = f"gradient of shard {part.shard}"
                checked.append(check_tensors(part.names, part_tensors, owner.specs, what=what))
            elif part_tensors or part.names:
                raise InvalidMessage("a fetch carries no tensors")
            else:
                checked.append(None)
        targets: dict[int, int | None] = {}  # shard -> the step to wait for (None: late, answer now)
        for part, grads in zip(request.parts, checked, strict=True):
            targets[part.shard] = part.step if grads is None else self._submit(part, grads, sender)
        waits = [
            self.owned[shard].wait_for(target, request.wait_s)
            for shard, target in targets.items()
            if target is not None
        ]
        await asyncio.gather(*waits)
        out_parts: list[ReplyPart] = []
        out_tensors: list[torch.Tensor] = []
        for shard, target in targets.items():
            owner = self.owned[shard]
            if target is not None and owner.step < target and not owner.final:
                out_parts.append(
                    ReplyPart(shard=shard, kind=ReplyKind.PENDING, step=owner.step, pending=owner.num_pending)
                )
                continue
            kind = ReplyKind.LATE if target is None else ReplyKind.APPLIED
            answer, params = self._reply(owner, kind, sender, shard)
            out_parts.append(answer)
            out_tensors += params
        return SyncReply(parts=tuple(out_parts)), out_tensors

    def _submit(self, part: PushPart, grads: dict[str, torch.Tensor], sender: str) -> int | None:
        """Count one part's gradient; the step its reply waits for (None: late, answered at once).

        Raises:
            InvalidMessage: refused (a step ahead of the shard, or rejected by the aggregator).
        """
        owner = self.owned[part.shard]
        try:
            result = owner.submit(sender, part.step, grads)
            if (
                result.verdict == Verdict.FUTURE  # well-formed (submit checked it), one step ahead
                and part.shard in self.taken_over
                and part.step == owner.step + 1
                and owner.fast_forward(part.step)
            ):
                # the dead owner applied one more step and answered this worker: go on from there
                # (that step's update is lost for this shard) rather than refuse every worker that
                # saw it
                logger.info(
                    "job %s: shard %d fast-forwarded to step %d", self.job.job_id, part.shard, part.step
                )
                result = owner.submit(sender, part.step, grads)
        except GradientRejected as exc:
            raise InvalidMessage(str(exc)) from None
        if result.verdict == Verdict.FUTURE:
            raise InvalidMessage(f"step {part.step} is ahead of shard {part.shard} (at {owner.step})")
        if result.verdict == Verdict.LATE:
            return None
        return part.step + 1

    def _reply(
        self, owner: ShardOwner, kind: ReplyKind, sender: str, shard: int
    ) -> tuple[ReplyPart, list[torch.Tensor]]:
        step, params = owner.snapshot()
        if owner.final:
            self.final_sent.setdefault(shard, set()).add(sender)
            if self.all_final_sent():
                self.all_final.set()
        part = ReplyPart(shard=shard, kind=kind, step=step, names=tuple(params), final=owner.final)
        return part, list(params.values())

    def missing_final(self) -> list[str]:
        """Live workers that have not fetched the final parameters of some shard we own."""
        live = self.layout.live(self.dead)
        return [w for w in live if any(w not in self.final_sent.get(s, set()) for s in self.owned)]

    def all_final_sent(self) -> bool:
        """Whether every live worker got the final parameters of every shard we own."""
        live = set(self.layout.live(self.dead))
        return all(
            owner.final and live <= self.final_sent.get(shard, set()) for shard, owner in self.owned.items()
        )
