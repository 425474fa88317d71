"""A sync_backup worker's side of one step's exchange with the shard owners (`SyncExchange`).

Split from `training.sync_runner` (the worker's loop) so that each file stays one concern. Each round
groups the shards still open by their owner under the dead set this peer knows, and sends every owner
one `sync_push` with a part per shard (`training.sync_wire`): its gradient slice, or a fetch once the
owner already counted it. The parts an owner answers are checked one by one before anything is written
(`_install`: the shards asked, each once, names, shapes, dtypes, finite); the shards still open
(pending, or their owner unreachable or replaced) go in the next round to whoever owns them then. An
unreachable owner is pinged and, silent for `owner_ping_timeout_s`, declared dead; a refusal is
followed by a ping that learns the owner's dead set, and fails the step unless a shard moved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from ravnest_p2p.errors import InvalidMessage, RavnestError, RemoteError, TransportError
from ravnest_p2p.strategies.sync_layout import SyncLayout
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.sync_owners import OwnerService
from ravnest_p2p.training.sync_wire import (
    SYNC_PUSH,
    PushPart,
    ReplyKind,
    ReplyPart,
    SyncPush,
    SyncReply,
    check_tensors,
    split_parts,
)
from ravnest_p2p.transport.rpc import CallContext, Reply, RpcEndpoint

__all__ = ["SyncExchange"]

logger = logging.getLogger(__name__)

_WAIT_S = 15.0  # one push's reply is held at most this long; the step deadline bounds the retries


class SyncExchange:
    """The exchange half of `SyncBackupRunner` (see the module docstring); the runner sets the state."""

    rpc: RpcEndpoint
    job: JobSpec
    layout: SyncLayout
    owners: OwnerService
    pieces: dict[str, Tensor]
    versions: list[int]

    async def _exchange(
        self, shards: list[int], step: int, grads: dict[str, Tensor] | None
    ) -> list[ReplyPart]:
        """Push the `shards`' gradients of `step` (or fetch them at `step`) until their owners answer.

        One message per owner per round; a round ends when every owner answered or failed, and the
        shards still open (pending, or their owner unreachable or replaced) go in the next round to
        whoever owns them then.
        """
        deadline = asyncio.get_running_loop().time() + self.job.sync_backup.step_timeout_s
        counted_by: dict[int, str] = {}  # shard -> the owner that has our gradient: from then on, fetch
        done: list[ReplyPart] = []
        todo = list(shards)
        while todo:
            owners = self.owners.owners()
            groups: dict[str, list[int]] = {}
            for shard in todo:
                groups.setdefault(owners[shard], []).append(shard)
            rounds = await asyncio.gather(
                *(
                    self._exchange_with(owner, group, step, grads, counted_by, deadline)
                    for owner, group in groups.items()
                )
            )
            todo = sorted(shard for finished, left in rounds for shard in left)
            done += [part for finished, _ in rounds for part in finished]
        return done

    async def _exchange_with(
        self,
        owner: str,
        shards: list[int],
        step: int,
        grads: dict[str, Tensor] | None,
        counted_by: dict[int, str],
        deadline: float,
    ) -> tuple[list[ReplyPart], list[int]]:
        """One message to `owner` for its `shards`: (the parts it answered, the shards still open)."""
        loop = asyncio.get_running_loop()
        parts, tensors = [], []
        for shard in shards:
            names = self.layout.shards[shard]
            pushing = grads is not None and counted_by.get(shard) != owner
            parts.append(
                PushPart(
                    shard=shard,
                    step=step + 1 if grads is not None and not pushing else step,
                    has_grads=pushing,
                    names=names if pushing else (),
                )
            )
            if pushing and grads is not None:
                tensors += [grads[name] for name in names]
        request = SyncPush(
            job_id=self.job.job_id,
            parts=tuple(parts),
            dead=tuple(sorted(self.owners.dead)),
            wait_s=min(_WAIT_S, max(0.0, deadline - loop.time())),
        )
        try:
            reply = await self._call(owner, request, tensors)
        except RemoteError as exc:
            if not await self._owner_moved(owner, shards):
                raise RavnestError(f"shards {shards}: owner {owner} refused step {step}: {exc}") from None
            return [], shards
        except TransportError as exc:
            logger.info("job %s: shards %s owner %s: %r", self.job.job_id, shards, owner, exc)
            await self.owners.confirm_dead(owner)
            self._check_deadline(deadline, shards, step, owner, None)
            return [], shards
        for part in parts:
            if part.has_grads:
                counted_by[part.shard] = owner
        answered = self._install(reply.message, reply.tensors, shards)
        pending = [answer for answer in answered if answer.kind == ReplyKind.PENDING]
        for answer in pending:
            self._check_deadline(deadline, [answer.shard], step, owner, answer.pending)
        finished = [answer for answer in answered if answer.kind != ReplyKind.PENDING]
        return finished, [answer.shard for answer in pending]

    def _check_deadline(
        self, deadline: float, shards: list[int], step: int, owner: str, pending: int | None
    ) -> None:
        if asyncio.get_running_loop().time() < deadline:
            return
        count = (
            f"has {pending} of {self.owners.num_required} gradients" if pending is not None else "is silent"
        )
        live = len(self.layout.live(self.owners.dead))
        raise RavnestError(
            f"step {step}: shards {shards}' owner {owner} {count} after "
            f"{self.job.sync_backup.step_timeout_s:.0f}s ({live} workers believed alive)"
        )

    async def _owner_moved(self, owner: str, shards: list[int]) -> bool:
        """After a refusal: learn the owner's dead set; whether one of the shards now has another owner."""
        pong = await self.owners.ping(owner)
        if pong is None or not pong.in_job:
            await self.owners.confirm_dead(owner)
        else:
            await self.owners.learn_dead([p for p in pong.dead if p != self.rpc.peer_id])
        owners = self.owners.owners()
        return any(owners[shard] != owner for shard in shards)

    async def _call(self, owner: str, request: SyncPush, tensors: Sequence[Tensor]) -> Reply[SyncReply]:
        if owner == self.rpc.peer_id:  # our own shard: no wire, the same checks
            try:
                message, out = await self.owners.handle_push(
                    request, list(tensors), CallContext(remote_peer_id=owner, method=SYNC_PUSH.name)
                )
            except InvalidMessage as exc:
                raise RemoteError(exc.code, str(exc)) from None
            return Reply(message=message, tensors=list(out))
        return await self.rpc.call(
            owner, SYNC_PUSH, request, tensors=tensors, timeout_s=request.wait_s + 30.0
        )

    def _install(self, reply: SyncReply, tensors: list[Tensor], shards: list[int]) -> list[ReplyPart]:
        """Check an owner's reply to a push of `shards` part by part, then write it into the model.

        Raises:
            InvalidMessage: a part for a shard not asked, twice, missing, or malformed (nothing written).
        """
        if sorted(part.shard for part in reply.parts) != sorted(shards):
            raise InvalidMessage(f"a reply for shards {[p.shard for p in reply.parts][:8]}, not {shards[:8]}")
        counts = [len(part.names) for part in reply.parts]
        checked = []
        for part, part_tensors in zip(reply.parts, split_parts(counts, tensors, what="reply"), strict=True):
            if part.kind == ReplyKind.PENDING:
                if part.names:
                    raise InvalidMessage(f"a pending part of shard {part.shard} carries tensors")
                continue
            expected = {
                name: (tuple(self.pieces[name].shape), self.pieces[name].dtype)
                for name in self.layout.shards[part.shard]
            }
            what = f"parameters of shard {part.shard}"
            checked.append((part, check_tensors(part.names, part_tensors, expected, what=what)))
        with torch.no_grad():
            for part, values in checked:
                for name, value in values.items():
                    self.pieces[name].copy_(value)
                self.versions[part.shard] = part.step
        return list(reply.parts)
