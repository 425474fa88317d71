"""The ring's traffic with the other members (a mixin; `averaging.ring` runs the rounds and owns the state).

Outgoing: an attempt's part streams to the right neighbour, opened all at once or not at all, one while
this peer's pipeline is sending, and the attempt's parts sent over them (`partstream.send_attempt`).
Incoming: the left neighbour's part streams, each matched to its running session (waiting, bounded, for
a round this member has not reached yet) or refused with a reason; the `ring_status` probes of members
whose attempt failed; the `ring_result` fetches of a held mean (`commit.py`), and how long that mean
stays held.

Why separate: `ring.py` reads as the round's algorithm (attempts, re-forming, committing); what goes
over the streams and RPCs is this mixin, so each module stays small. `RingAllReduce` declares and owns
every attribute listed here; the protocol is described in `ring.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import torch

from ravnest_p2p.averaging.base import RingConfig
from ravnest_p2p.averaging.commit import result_slice
from ravnest_p2p.averaging.early import EarlySlots
from ravnest_p2p.averaging.frames import ByteReader, ByteWriter, read_hello
from ravnest_p2p.averaging.messages import (
    ResultReply,
    ResultRequest,
    StatusReply,
    StatusRequest,
    StreamHello,
)
from ravnest_p2p.averaging.partstream import AttemptFailed, receive_attempt, refuse, send_attempt
from ravnest_p2p.averaging.session import RingRefused, RingSession
from ravnest_p2p.averaging.shards import ShardMap
from ravnest_p2p.averaging.streams import Streams
from ravnest_p2p.errors import InvalidMessage, TransportError
from ravnest_p2p.transport import CallContext, RpcEndpoint

__all__ = ["RingIO"]

logger = logging.getLogger(__name__)


class RingIO:
    """The streams and RPC handlers of `RingAllReduce` (which owns the state declared here)."""

    endpoint: RpcEndpoint
    config: RingConfig
    early: EarlySlots
    _streams: Streams
    _stream_name: str
    _sessions: dict[str, RingSession]
    _changed: asyncio.Event
    _expected: ShardMap | None
    _releases: dict[str, asyncio.TimerHandle]

    @property
    def peer_id(self) -> str:
        raise NotImplementedError

    async def _open(self, peer_id: str) -> list[tuple[ByteReader, ByteWriter]]:
        """New part streams to `peer_id` (all of them, or none).

        `config.streams_per_neighbour` of them, but one while this peer's pipeline is sending: each
        stream's writer claims the traffic gate's background share on its own, so two took twice the
        share from the pipeline (lab, 2 x 2 stages at 100 Mbit/s: samples/s while averaging 0.86 of
        without, against 0.99 with one stream in the same setup).
        """
        count = 1 if self._streams.foreground_recent() else self.config.streams_per_neighbour
        # each open under its own deadline, so that the streams that did open are returned and closed
        opens = [self._open_one(peer_id) for _ in range(count)]
        opened = await asyncio.gather(*opens, return_exceptions=True)
        failed = next((x for x in opened if isinstance(x, BaseException)), None)
        if failed is not None:
            for x in opened:
                if isinstance(x, tuple):
                    x[1].close()
            raise failed
        return [x for x in opened if isinstance(x, tuple)]

    async def _open_one(self, peer_id: str) -> tuple[ByteReader, ByteWriter]:
        async with asyncio.timeout(self.config.step_timeout_s):
            return await self._streams.open(peer_id, self._stream_name)

    async def _attempt(
        self, session: RingSession, opening: asyncio.Task[list[tuple[ByteReader, ByteWriter]]] | None
    ) -> None:
        """One attempt over new streams to the right neighbour (`opening`: ones already on their way)."""
        try:
            streams = await (opening if opening is not None else self._open(session.right))
        except (TransportError, TimeoutError) as exc:
            session.stop_attempt()
            raise AttemptFailed(f"cannot open a stream to {session.right}: {exc!r}") from None
        await send_attempt(session, streams, self.config)

    def _release(self, ring_id: str) -> None:
        """Drop the mean held for `ring_id`'s previous round (memory: a copy of the shard)."""
        handle = self._releases.pop(ring_id, None)
        if handle is not None:
            handle.cancel()
        previous = self._sessions.get(ring_id)
        if previous is not None:
            previous.release()

    def _linger(self, session: RingSession) -> None:
        """Keep a held mean for the members still fetching it (`commit.py`): until this ring's next
        round starts here, at most three step deadlines."""
        previous = self._releases.pop(session.ring_id, None)
        if previous is not None:
            previous.cancel()
        if session.result is not None:
            loop = asyncio.get_running_loop()
            # a member still in the attempt notices its failure within a step deadline, probes, fetches
            linger_s = min(self.config.round_timeout_s, 3 * self.config.step_timeout_s)
            self._releases[session.ring_id] = loop.call_later(linger_s, session.release)

    # ----- serving -------------------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _on_stream(self, sender: str, reader: ByteReader, writer: ByteWriter) -> None:
        """One incoming part stream: hello, then parts until the sender closes; refusals get a reason."""
        try:
            try:
                async with asyncio.timeout(self.config.step_timeout_s):
                    hello = await read_hello(reader)
                session = await self._session_for(hello, sender)
                session.check_stream(hello, sender)
                await receive_attempt(session, hello.attempt, reader, writer, self.config)
            except InvalidMessage as exc:  # RingRefused, StaleEpoch, a malformed frame
                logger.debug("refused a ring stream from %s: %s", sender, exc)
                await refuse(reader, writer, exc)
        except (TimeoutError, ConnectionError, OSError, EOFError) as exc:
            logger.debug("ring stream from %s ended: %r", sender, exc)
        finally:
            writer.close()

    async def _session_for(self, hello: StreamHello, sender: str) -> RingSession:
        """The running session `hello` belongs to, waiting (bounded) if this member is not there yet."""
        deadline = time.monotonic() + self.config.step_timeout_s
        with contextlib.ExitStack() as slot:
            holding = False
            while True:
                changed = self._changed
                session = self._sessions.get(hello.ring_id)
                if session is not None and session.round == hello.round:
                    if session.attempt == hello.attempt and session.running:
                        return session
                    if (
                        hello.attempt < session.attempt
                        or session.done
                        or (hello.attempt == session.attempt and not session.running)
                    ):
                        raise RingRefused(
                            "stale_attempt", f"{hello.ring_id}: attempt {hello.attempt} is over"
                        )
                    if session.running and sender in session.members:  # a member is ahead: mine failed
                        session.stop_attempt()
                        self._notify()
                        changed = self._changed
                elif session is not None and session.round > hello.round:
                    raise RingRefused("stale_round", f"{hello.ring_id}: round {hello.round} is over")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RingRefused(
                        "not_ready", f"{hello.ring_id}: round {hello.round} not reached in time"
                    )
                if not holding:  # an early stream waits unread: the sender's bytes stay queued
                    slot.enter_context(self.early.hold(hello.ring_id, sender))
                    holding = True
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await changed.wait()

    async def _on_status(
        self, req: StatusRequest, tensors: list[torch.Tensor], ctx: CallContext
    ) -> StatusReply:
        session = self._sessions.get(req.ring_id)
        if session is None or session.round != req.round or session.epoch != req.epoch:
            return StatusReply(alive=False, attempt=0, behind=self._behind(req, ctx.remote_peer_id))
        prober_in = ctx.remote_peer_id in session.members
        if session.running and session.attempt <= req.failed_attempt and prober_in:
            session.stop_attempt()  # the prober's attempt failed, so ours cannot complete either
            self._notify()
        return StatusReply(
            alive=True,
            attempt=max(session.attempt, 0),
            done=session.done,
            members=list(session.members),
            holds=session.holds,
        )

    async def _on_result(
        self, req: ResultRequest, tensors: list[torch.Tensor], ctx: CallContext
    ) -> ResultReply | tuple[ResultReply, list[torch.Tensor]]:
        mean = result_slice(self._sessions.get(req.ring_id), req, ctx.remote_peer_id)
        return ResultReply(available=False) if mean is None else (ResultReply(available=True), [mean])

    def _behind(self, req: StatusRequest, prober: str) -> bool:
        """Whether this member has not reached `req`'s round of a ring it expects with the prober in it."""
        expected = self._expected
        if expected is None or expected.epoch != req.epoch:
            return False
        shard = next((s for s in expected.shards if s.ring_id == req.ring_id), None)
        if shard is None or prober not in shard.ring or self.peer_id not in shard.ring:
            return False
        session = self._sessions.get(req.ring_id)
        return session is None or session.epoch != req.epoch or session.round < req.round
