"""Multi-ring all-reduce over the typed RPC: every shard's owners average it, all rings at once.

Problem. Replicas of a model, split differently into stages, must be averaged across clusters with no
coordinator, over links of a few MB/s, while some members die or stall.

Algorithm. Each shard of the `ShardMap` is averaged by its own ring (Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009: reduce-scatter + all-gather,
2(C-1)/C of the data per member, the bandwidth lower bound). A peer runs the rings of all its shards
concurrently (`asyncio.gather`) on one RPC server, so a stage owner's upload is busy with every shard at
once. Parts are pipelined (see `session.py`) with `parts_in_flight` sends outstanding per ring, so the
next part travels while the previous one is being summed. Optional lossy compression (fp16, ...) applies
to every part; with it, the owner of a reduced chunk keeps the decoded (compressed) copy so that every
replica ends with bit-identical values.

Faults. Every send and every wait has the step deadline, every round the round deadline: nothing waits
forever. When an attempt fails at a member (a send fails or times out, a part does not arrive in time,
or it learns that someone else's attempt failed), it stops, and *probes* every member of the failed
attempt (`ring_status`, short deadline). A probe also tells a member still running that attempt to stop,
so failure spreads around the ring in one RTT instead of one deadline per hop. Members that answer and
are still in the round form the next attempt, in the same ring order, restarting from their original
local values: the result is exactly the mean over the members of the attempt that completed, and
every message carries a digest of the member list, so two members that disagree on who is in cannot
complete an attempt together (they fail and probe again). A probe answer that shows a later attempt is
adopted as is (skip ahead), which makes views converge; a member left out of it gives up for the round.
After `max_attempts` or the round deadline, a member keeps its local values for this round: a slow or
partitioned member costs its own averaging, never the others' training.

Alternatives rejected. Resuming from partial sums after a failure (saves a restart) needs every
survivor to agree on which parts of the dead member were already folded in, i.e. a consensus per part;
restarting costs one more pass over the shard only when someone fails. hivemind's averager forms groups
by DHT matchmaking and splits by peer bandwidth; our rings are fixed by the plan and need no matchmaking.

Limits. A member that completed an attempt while its successor failed on the last step keeps that
average while the others form a new attempt without it: replicas then differ by one round's averaging
until the next round. Probes decide liveness, not speed: a member that answers probes but moves slower
than the step deadline is dropped only after its attempt fails `max_attempts` times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import torch

from ravnest_p2p.averaging.base import RingConfig, RingMetrics, RoundMetrics, flatten_shard, split_shard
from ravnest_p2p.averaging.messages import (
    RING_GATHER,
    RING_REDUCE,
    RING_STATUS,
    PartAck,
    PartMessage,
    StatusReply,
    StatusRequest,
)
from ravnest_p2p.averaging.session import Phase, RingRefused, RingSession, wire_bytes
from ravnest_p2p.averaging.shards import Shard, ShardMap
from ravnest_p2p.errors import TransportError
from ravnest_p2p.transport import CallContext, Compression, RpcEndpoint, decode_tensor, encode_tensor

__all__ = ["RingAllReduce"]

logger = logging.getLogger(__name__)

_UNSERVE_TIMEOUT_S = 5.0


class _AttemptFailed(Exception):
    pass


class RingAllReduce:
    """Serves `ring_reduce` / `ring_gather` / `ring_status` and runs this peer's rings.

    Args:
        endpoint: the peer's RPC endpoint (its namespace is the run id).
        config: deadlines, part size, compression.
    """

    def __init__(self, endpoint: RpcEndpoint, config: RingConfig | None = None) -> None:
        self.endpoint = endpoint
        self.config = config or RingConfig()
        self._sessions: dict[str, RingSession] = {}
        self._changed = asyncio.Event()
        self._buffered_messages = 0
        self._buffered_bytes = 0
        self._serving = False

    @property
    def peer_id(self) -> str:
        return self.endpoint.peer_id

    async def start(self) -> None:
        await self.endpoint.serve(RING_REDUCE, self._on_reduce)
        await self.endpoint.serve(RING_GATHER, self._on_gather)
        await self.endpoint.serve(RING_STATUS, self._on_status)
        self._serving = True

    async def aclose(self) -> None:
        if self._serving:
            self._serving = False
            try:
                async with asyncio.timeout(_UNSERVE_TIMEOUT_S):  # a dead daemon must not hang shutdown
                    for method in (RING_REDUCE, RING_GATHER, RING_STATUS):
                        await self.endpoint.unserve(method)
            except TimeoutError:
                logger.warning("ring handlers of %s not removed in %ss", self.peer_id, _UNSERVE_TIMEOUT_S)
        for session in self._sessions.values():
            session.stop_attempt()
        self._notify()

    async def __aenter__(self) -> RingAllReduce:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ----- one round over all my rings -----------------------------------------------------------
    async def all_reduce(
        self, shard_map: ShardMap, tensors: Mapping[str, torch.Tensor], *, round_index: int
    ) -> tuple[dict[str, torch.Tensor], RoundMetrics]:
        """Average every shard this peer owns with the other owners; all rings run concurrently.

        Args:
            shard_map: this epoch's map (same at every peer).
            tensors: at least every name of every shard this peer owns (a snapshot: not modified).
            round_index: the round number, the same at every member of a ring.

        Returns:
            The averaged tensors (same names, shapes and dtypes) and this round's metrics. A ring that
            could not complete returns the local values, with only this peer as participant.

        Raises:
            ValueError: a name of one of my shards is missing or has the wrong size.
        """
        started = time.monotonic()
        shards = shard_map.shards_of(self.peer_id)
        for shard in shards:
            for name, numel in zip(shard.names, shard.numels, strict=True):
                if name not in tensors or tensors[name].numel() != numel:
                    raise ValueError(f"{name!r}: missing or not {numel} elements")
        results = await asyncio.gather(
            *(self._run_ring(shard_map.epoch, shard, tensors, round_index) for shard in shards)
        )
        averaged: dict[str, torch.Tensor] = {}
        for named, _ in results:
            averaged.update(named)
        rings = [m for _, m in results]
        metrics = RoundMetrics(
            round=round_index,
            time_s=time.monotonic() - started,
            bytes_sent=sum(r.bytes_sent for r in rings),
            bytes_received=sum(r.bytes_received for r in rings),
            rings=rings,
        )
        return averaged, metrics

    async def _run_ring(
        self, epoch: int, shard: Shard, tensors: Mapping[str, torch.Tensor], round_index: int
    ) -> tuple[dict[str, torch.Tensor], RingMetrics]:
        started = time.monotonic()
        parts = [tensors[n] for n in shard.names]
        local = await flatten_shard(parts, shard.numel)
        part_numel = max(1, self.config.part_size_bytes // 4)
        session = RingSession(
            ring_id=shard.ring_id,
            epoch=epoch,
            round_index=round_index,
            me=self.peer_id,
            local=local,
            part_numel=part_numel,
        )
        self._sessions[shard.ring_id] = session
        self._notify()
        deadline = time.monotonic() + self.config.round_timeout_s
        members: tuple[str, ...] | None = shard.ring
        attempt, result = 0, local
        participants: tuple[str, ...] = (self.peer_id,)
        try:
            while members is not None and len(members) >= 2:
                session.start_attempt(attempt, members)
                self._notify()
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        await self._attempt(session)
                    result, participants = session.average(), session.members
                    break
                except (_AttemptFailed, TimeoutError) as exc:
                    session.stop_attempt()
                    self._notify()
                    logger.info(
                        "ring %s round %d attempt %d failed: %s", shard.ring_id, round_index, attempt, exc
                    )
                    if attempt + 1 >= self.config.max_attempts or time.monotonic() >= deadline:
                        members = None
                        break
                    attempt, members = await self._reform(session, deadline)
        finally:
            session.finish(done=True)
            self._notify()
        named = await split_shard(result, shard, tensors)
        metrics = RingMetrics(
            ring_id=shard.ring_id,
            numel=shard.numel,
            participants=participants,
            attempts=session.attempt + 1,
            time_s=time.monotonic() - started,
            bytes_sent=session.bytes_sent,
            bytes_received=session.bytes_received,
        )
        return named, metrics

    async def _attempt(self, session: RingSession) -> None:
        window = asyncio.Semaphore(self.config.parts_in_flight)
        timeout_s = self.config.step_timeout_s
        failures: list[str] = []
        tasks: list[asyncio.Task[None]] = []

        def check(arrived: bool, what: str) -> None:
            if failures:
                raise _AttemptFailed(failures[0])
            if not arrived:
                raise _AttemptFailed(f"{what} did not arrive in {timeout_s}s (or the attempt was stopped)")

        try:
            for step in range(session.num_steps):
                for part in range(session.num_parts(session.send_chunk(step))):
                    if step > 0:
                        arrived = await session.wait_received(step - 1, part, timeout_s)
                        check(arrived, f"part {part} of step {step - 1}")
                    await window.acquire()
                    check(True, "")
                    tasks.append(asyncio.create_task(self._send(session, step, part, window, failures)))
            last = session.num_steps - 1
            for part in range(session.num_parts(session.recv_chunk(last))):
                check(await session.wait_received(last, part, timeout_s), f"part {part} of the last step")
            await asyncio.gather(*tasks)
            check(True, "")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send(
        self, session: RingSession, step: int, part: int, window: asyncio.Semaphore, failures: list[str]
    ) -> None:
        """Send one part to the right neighbour; a transport failure stops the attempt (never raises it)."""
        try:
            chunk = session.send_chunk(step)
            lo, hi = session.part_bounds(chunk, part)
            compression = self.config.compression
            if compression is not Compression.NONE and step == session.size - 1:
                # the owner of a reduced chunk keeps what the others will decode, so replicas agree
                session.acc[lo:hi] = decode_tensor(encode_tensor(session.acc[lo:hi], compression))
            message = PartMessage(
                ring_id=session.ring_id,
                epoch=session.epoch,
                round=session.round,
                attempt=session.attempt,
                members_digest=session.digest,
                step=step,
                chunk=chunk,
                part=part,
            )
            method = RING_REDUCE if session.phase(step) is Phase.REDUCE else RING_GATHER
            await self.endpoint.call(
                session.right,
                method,
                message,
                tensors=[session.acc[lo:hi]],
                timeout_s=self.config.step_timeout_s,
                compression=compression,
            )
            session.bytes_sent += wire_bytes(hi - lo, compression)
        except TransportError as exc:
            failures.append(f"sending to {session.right} failed: {exc}")
            session.stop_attempt()
        finally:
            window.release()

    async def _reform(self, session: RingSession, deadline: float) -> tuple[int, tuple[str, ...] | None]:
        """After a failed attempt: probe the members; return the next (attempt, members) or None."""
        failed = session.attempt
        others = [m for m in session.members if m != self.peer_id]
        request = StatusRequest(
            ring_id=session.ring_id, epoch=session.epoch, round=session.round, failed_attempt=failed
        )
        timeout_s = max(0.01, min(self.config.probe_timeout_s, deadline - time.monotonic()))
        replies = await asyncio.gather(
            *(self.endpoint.call(m, RING_STATUS, request, timeout_s=timeout_s) for m in others),
            return_exceptions=True,
        )
        alive: set[str] = {self.peer_id}
        ahead: StatusReply | None = None
        for member, reply in zip(others, replies, strict=True):
            if isinstance(reply, asyncio.CancelledError):
                raise reply
            if isinstance(reply, BaseException):
                logger.debug("probe of %s failed: %r", member, reply)
                continue
            status = reply.message
            if status.alive and not status.done:
                alive.add(member)
                if status.attempt > failed and (ahead is None or status.attempt > ahead.attempt):
                    ahead = status
        if ahead is not None:
            if self.peer_id not in ahead.members:
                return ahead.attempt, None
            return ahead.attempt, tuple(ahead.members)
        return failed + 1, tuple(m for m in session.members if m in alive)

    # ----- serving -------------------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _on_reduce(self, msg: PartMessage, tensors: list[torch.Tensor], ctx: CallContext) -> PartAck:
        return await self._on_part(Phase.REDUCE, msg, tensors, ctx)

    async def _on_gather(self, msg: PartMessage, tensors: list[torch.Tensor], ctx: CallContext) -> PartAck:
        return await self._on_part(Phase.GATHER, msg, tensors, ctx)

    async def _on_part(
        self, phase: Phase, msg: PartMessage, tensors: list[torch.Tensor], ctx: CallContext
    ) -> PartAck:
        if len(tensors) != 1:
            raise RingRefused("wrong_shape", f"expected one tensor, got {len(tensors)}")
        session = await self._session_for(
            msg, ctx.remote_peer_id, tensors[0].numel() * tensors[0].element_size()
        )
        session.accept(phase, msg, tensors[0], ctx.remote_peer_id)
        session.bytes_received += wire_bytes(tensors[0].numel(), self.config.compression)
        return PartAck()

    async def _session_for(self, msg: PartMessage, sender: str, size_bytes: int) -> RingSession:
        """The running session `msg` belongs to, waiting (bounded) if this member is not there yet."""
        deadline = time.monotonic() + self.config.step_timeout_s
        while True:
            changed = self._changed
            session = self._sessions.get(msg.ring_id)
            if session is not None and session.round == msg.round:
                if session.attempt == msg.attempt and session.running:
                    return session
                if (
                    msg.attempt < session.attempt
                    or session.done
                    or (msg.attempt == session.attempt and not session.running)
                ):
                    raise RingRefused("stale_attempt", f"{msg.ring_id}: attempt {msg.attempt} is over")
                if session.running and sender in session.members:  # a member is ahead: mine failed
                    session.stop_attempt()
                    self._notify()
                    changed = self._changed
            elif session is not None and session.round > msg.round:
                raise RingRefused("stale_round", f"{msg.ring_id}: round {msg.round} is over")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RingRefused("not_ready", f"{msg.ring_id}: round {msg.round} not reached in time")
            if (
                self._buffered_messages >= self.config.max_buffered_messages
                or self._buffered_bytes + size_bytes > self.config.max_buffered_bytes
            ):
                raise RingRefused("busy", "too many early messages buffered")
            self._buffered_messages += 1
            self._buffered_bytes += size_bytes
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                pass
            finally:
                self._buffered_messages -= 1
                self._buffered_bytes -= size_bytes

    async def _on_status(
        self, req: StatusRequest, tensors: list[torch.Tensor], ctx: CallContext
    ) -> StatusReply:
        session = self._sessions.get(req.ring_id)
        if session is None or session.round != req.round or session.epoch != req.epoch:
            return StatusReply(alive=False, attempt=0)
        prober_in = ctx.remote_peer_id in session.members
        if session.running and session.attempt <= req.failed_attempt and prober_in:
            session.stop_attempt()  # the prober's attempt failed, so ours cannot complete either
            self._notify()
        return StatusReply(
            alive=True, attempt=max(session.attempt, 0), done=session.done, members=list(session.members)
        )
