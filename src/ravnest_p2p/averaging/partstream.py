"""One attempt's data plane: a member streams its parts to its right neighbour and takes its left's.

Sender (`send_attempt`): `RingConfig.streams_per_neighbour` streams per (ring, attempt) to the right
neighbour; the parts in ring order (step by step, part by part) dealt round-robin over them, part p of
step t as soon as part p of step t-1 arrived from the left, so consecutive steps overlap and the link
never idles after the first part. Each write waits for its stream's back-pressure under the step
deadline, so a neighbour that stops reading fails the attempt in `step_timeout_s`, never hangs it. A
task per stream reads the neighbour's acks; the attempt completes only once the neighbour acknowledged
every part (an error frame or a broken stream stops the attempt at once).

Why more than one stream to the same neighbour: the daemons multiplex streams over one connection, each
stream with its own flow-control window, and on a loaded uplink the window updates queue behind the
receiver's own parts. With one stream, the sender's TCP socket held at most ~225-270 segments unacked
(`ss -ti` in the lab namespaces; congestion window ~700, no losses): the stream window, not the link,
was the limit, and a member's uplink ran at 0.91-0.94 of the wire rate (0.957 is the TCP payload
ceiling). Two streams, each driven by its own task so one waiting for its window does not hold back the
other, keep it at ~0.95: 64 MB among 4 lab peers at 100 Mbit/s, 8.20-8.26 s/round against 8.47-8.88 s
with one (3 and 4 streams: no better). Two rings running in opposite directions over the shard's halves
(each member sending to both neighbours) were tried too: 10.1-10.3 s, as the two flows sharing an
uplink got unequal shares and each half-ring runs at its slowest link's pace.

Receiver (`receive_attempt`): header checked against the session, payload read into a reusable buffer,
decoded (a view of that buffer when uncompressed), checked (shape, finite), then added in place into the
accumulator (reduce) or copied there (gather), acked. A stream that goes silent for two step deadlines is
dropped (the receiving member's own waits have failed its attempt by then).

Pacing (opt-in, `RingConfig.pace_fraction` with link rates in bytes/s): the sender spaces its payload
in 64 KiB slices to that fraction of min(its upload, its right neighbour's download). A member's uplink
carries its parts and the TCP acks of what its left neighbour sends it; an unpaced sender fills the
uplink's queue (hundreds of ms on a home link), loses packets there and recovers slowly because its own
acks wait in its downlink's full queue. Lab, 25 Mbit/s member receiving and sending 16 MiB at once:
upload 15-17 Mbit/s unpaced, 21.8 paced at 22.

Priority: when the stream's writer is a `BackgroundWriter`, each part first yields to this peer's
pipeline sends (`transport/priority.py`): while they are busy, at most a window of parts stays
unacknowledged (over all the attempt's streams together: one window per stream doubled averaging's
share and cost the pipeline at 25 Mbit/s, 0.83 of its samples/s without averaging), and a part waits
for the pipeline send in progress to end, for at most a budget that leaves averaging
`GateConfig.min_share` of the link's time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import torch

from ravnest_p2p.averaging.base import RingConfig
from ravnest_p2p.averaging.deltawire import WireCodec
from ravnest_p2p.averaging.frames import (
    ByteReader,
    ByteWriter,
    Pacer,
    PartHeader,
    all_finite,
    decode_payload,
    encode_payload,
    max_payload_bytes,
    read_ack,
    read_part_header,
    read_payload_into,
    write_ack,
    write_error,
    write_hello,
    write_part,
)
from ravnest_p2p.averaging.messages import StreamHello
from ravnest_p2p.averaging.pseudograd import DeltaCompression
from ravnest_p2p.averaging.session import RingRefused, RingSession
from ravnest_p2p.averaging.streams import BackgroundWriter
from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.transport import Compression, decode_tensor, encode_tensor
from ravnest_p2p.utils.aio import run_in_compute_thread

__all__ = ["AttemptFailed", "receive_attempt", "refuse", "send_attempt"]

logger = logging.getLogger(__name__)

_LINGER_S = 1.0
_INLINE_NUMEL = 1 << 16  # encode larger parts on the compute thread
_STREAM_ERRORS = (ConnectionError, OSError, EOFError)  # EOFError covers asyncio.IncompleteReadError


class AttemptFailed(Exception):
    """This member's current attempt cannot complete (the reason is the message)."""


class _Acks:
    """Parts the neighbour acknowledged on all of an attempt's streams, or the first error."""

    def __init__(self) -> None:
        self.count = 0
        self.error: str | None = None
        self._changed = asyncio.Event()

    def update(self, more: int = 0, error: str | None = None) -> None:
        self.count += more
        if error is not None and self.error is None:
            self.error = error
        self._changed.set()

    async def wait_for(self, count: int, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while self.count < count and self.error is None:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AttemptFailed(f"{count - self.count} parts unacknowledged after {timeout_s}s") from None
        if self.error is not None:
            raise AttemptFailed(self.error)


async def _read_acks(session: RingSession, reader: ByteReader, acks: _Acks) -> None:
    right = session.right
    taken = 0  # a stream's acks count its own parts
    try:
        while True:
            count, error = await read_ack(reader)
            if error is not None:
                acks.update(error=f"{right} refused a part: {error['code']}: {error['message']}")
                break
            if count > taken:
                acks.update(more=count - taken)
                taken = count
    except (*_STREAM_ERRORS, InvalidMessage) as exc:
        acks.update(error=f"stream to {right} broke: {type(exc).__name__}: {exc}")
    session.stop_attempt()  # wakes the sender's waits, which then report `acks.error`


async def _send_part(
    session: RingSession,
    writer: ByteWriter,
    step: int,
    part: int,
    config: RingConfig,
    pacer: Pacer | None = None,
) -> None:
    chunk = session.send_chunk(step)
    lo, hi = session.part_bounds(chunk, part)
    if session.wire is not None:
        payload: bytes | memoryview = await _wire_payload(session, step, chunk, part, lo, hi)
        header = PartHeader(session.wire.kind, step, chunk, part, memoryview(payload).nbytes)
    else:
        codec = Compression(config.compression)
        if codec is not Compression.NONE and step == session.size - 1:
            # the owner of a reduced chunk keeps what the others will decode, so replicas agree bitwise
            if codec is Compression.FP16:
                session.acc[lo:hi] = session.acc[lo:hi].half().float()
            else:
                session.acc[lo:hi] = decode_tensor(encode_tensor(session.acc[lo:hi], codec))
        payload = encode_payload(session.acc[lo:hi], codec)
        header = PartHeader(codec, step, chunk, part, memoryview(payload).nbytes)
    try:
        async with asyncio.timeout(config.step_timeout_s):
            await write_part(writer, header, payload, pacer)
    except TimeoutError:
        raise AttemptFailed(f"{session.right} took no part in {config.step_timeout_s}s") from None
    except _STREAM_ERRORS as exc:
        raise AttemptFailed(f"sending to {session.right} failed: {type(exc).__name__}: {exc}") from None
    session.bytes_sent += header.payload_bytes


async def _wire_payload(session: RingSession, step: int, chunk: int, part: int, lo: int, hi: int) -> bytes:
    """A part's bytes under the session's Δ codec (`deltawire.py`).

    Reduce steps encode the partial sum; the owner of a reduced chunk (first gather step) encodes it
    and keeps the decoded copy; later gather steps forward the bytes received, never re-encoded, so
    every member decodes the owner's bytes. What an encoding drops goes to `session.errors`.
    """
    wire = session.wire
    assert wire is not None
    if step >= session.size:
        payload = session.relay.pop((chunk, part), None)
        if payload is None:  # arrived parts are always stored before their waiters wake
            raise AttemptFailed(f"part {part} of chunk {chunk} to forward is missing")
        return payload
    values = session.acc[lo:hi]
    payload, decoded = await _roundtrip(wire, values)
    if wire.lossy:
        session.errors[lo:hi] += values - decoded
    if step == session.size - 1:
        session.acc[lo:hi] = decoded
    return payload


async def _roundtrip(wire: WireCodec, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    if values.numel() <= _INLINE_NUMEL:
        return wire.roundtrip(values)
    return await run_in_compute_thread(wire.roundtrip, values)


async def _yield_to_foreground(writer: ByteWriter, acks: _Acks, sent: int, config: RingConfig) -> None:
    """Before a part: yield to the pipeline's sends (`sent`, `acks`: over all the attempt's streams)."""
    if not isinstance(writer, BackgroundWriter):
        return
    window = writer.gate.background_window_parts(config.part_size_bytes)
    if window is not None and sent - acks.count >= window:
        started = time.monotonic()
        await acks.wait_for(sent - window + 1, config.step_timeout_s)
        writer.busy_s += time.monotonic() - started  # our parts were still on the way meanwhile
    await writer.turn()


async def send_attempt(
    session: RingSession, streams: Sequence[tuple[ByteReader, ByteWriter]], config: RingConfig
) -> None:
    """Run this member's side of the current attempt over open streams to its right neighbour.

    Part k of the attempt (in ring order: step by step, part by part) travels on stream k mod n, each
    stream driven by its own task, so a stream that waits for its flow-control window does not hold
    back the parts of the others.

    Returns when every part was sent and acknowledged and every part from the left arrived.

    Raises:
        AttemptFailed: a deadline passed, a stream broke, the neighbour refused a part, or the attempt
            was stopped (by a probe or by the receiving side).
    """
    assert streams
    timeout_s = config.step_timeout_s
    acks = _Acks()
    sent = 0

    def check(arrived: bool, what: str) -> None:
        if acks.error is not None:
            raise AttemptFailed(acks.error)
        if not arrived:
            raise AttemptFailed(f"{what} did not arrive in {timeout_s}s (or the attempt was stopped)")

    hello = StreamHello(
        ring_id=session.ring_id,
        epoch=session.epoch,
        round=session.round,
        attempt=session.attempt,
        members_digest=session.digest,
        chunks_digest=session.chunks_digest,
        codec="" if session.wire is None else session.wire.label,
    )
    rate = session.link_rate()
    pacer = None if config.pace_fraction is None or rate is None else Pacer(rate * config.pace_fraction)
    order = [
        (step, part)
        for step in range(session.num_steps)
        for part in range(session.num_parts(session.send_chunk(step)))
    ]
    started = time.monotonic()
    waited_s = 0.0  # time a stream idled because the left neighbour's part had not arrived

    async def drive(writer: ByteWriter, parts: list[tuple[int, int]]) -> None:
        nonlocal waited_s, sent
        for step, part in parts:
            if step > 0:
                t0 = time.monotonic()
                arrived = await session.wait_received(step - 1, part, timeout_s)
                waited_s += time.monotonic() - t0
                check(arrived, f"part {part} of step {step - 1}")
            await _yield_to_foreground(writer, acks, sent, config)
            check(session.running, "the attempt")
            sent += 1  # counted before the write: the other stream's yield must see it in flight
            await _send_part(session, writer, step, part, config, pacer)

    tasks = [
        asyncio.create_task(_read_acks(session, reader, acks), name=f"acks:{session.ring_id}")
        for reader, _ in streams
    ]
    try:
        try:
            for _, writer in streams:
                write_hello(writer, hello)
        except _STREAM_ERRORS as exc:
            raise AttemptFailed(f"sending to {session.right} failed: {exc!r}") from None
        drivers = [
            asyncio.create_task(drive(writer, order[j :: len(streams)]), name=f"send:{session.ring_id}:{j}")
            for j, (_, writer) in enumerate(streams)
        ]
        tasks += drivers
        await asyncio.gather(*drivers)  # the first failure propagates; `finally` stops the others
        last = session.num_steps - 1
        for part in range(session.num_parts(session.recv_chunk(last))):
            check(await session.wait_received(last, part, timeout_s), f"part {part} of the last step")
        await acks.wait_for(sent, timeout_s)
        logger.debug(
            "ring %s attempt %d: %d parts on %d stream(s) in %.2fs, %.2fs idle waiting for the left",
            session.ring_id,
            session.attempt,
            len(order),
            len(streams),
            time.monotonic() - started,
            waited_s,
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, writer in streams:
            writer.close()


async def receive_attempt(
    session: RingSession, attempt: int, reader: ByteReader, writer: ByteWriter, config: RingConfig
) -> None:
    """Take the left neighbour's parts of `attempt` from its stream until it ends.

    Raises:
        RingRefused: a part does not belong to this attempt (nothing was changed; the caller replies).
        TimeoutError, ConnectionError, EOFError: the stream went silent or broke.
    """
    wire = session.wire
    codec: Compression | DeltaCompression = Compression(config.compression) if wire is None else wire.kind
    scratch = bytearray()
    accepted = 0
    while True:
        async with asyncio.timeout(2 * config.step_timeout_s):
            header = await read_part_header(reader)
        if header is None:
            return
        if header.codec is not codec:
            raise RingRefused("wrong_codec", f"{session.ring_id}: {header.codec}, expected {codec}")
        lo, hi = session.expect(attempt, header.step, header.chunk, header.part)
        if wire is not None:
            await _receive_wire_part(session, wire, header, hi - lo, reader, scratch, config)
            accepted += 1
            write_ack(writer, accepted)
            continue
        assert isinstance(codec, Compression)
        limit = max_payload_bytes(hi - lo, codec)
        exact = codec in (Compression.NONE, Compression.FP16)
        if header.payload_bytes > limit or (exact and header.payload_bytes != limit):
            raise RingRefused(
                "wrong_shape", f"{session.ring_id}: {header.payload_bytes} bytes for {hi - lo} values"
            )
        if len(scratch) < header.payload_bytes:
            scratch = bytearray(header.payload_bytes)
        async with asyncio.timeout(config.step_timeout_s):
            payload = await read_payload_into(reader, scratch, header.payload_bytes)
        try:
            tensor = decode_payload(payload, codec, hi - lo)
        except InvalidMessage as exc:
            raise RingRefused("wrong_shape", f"{session.ring_id}: {exc}") from None
        if not all_finite(tensor):
            raise RingRefused("non_finite", f"{session.ring_id}: non-finite values")
        session.accept(header.step, header.part, tensor)
        session.bytes_received += header.payload_bytes
        accepted += 1
        write_ack(writer, accepted)


async def _receive_wire_part(
    session: RingSession,
    wire: WireCodec,
    header: PartHeader,
    numel: int,
    reader: ByteReader,
    scratch: bytearray,
    config: RingConfig,
) -> None:
    """Read, check and take one Δ part; keep its bytes if this member forwards them (gather)."""
    limit = wire.max_bytes(numel)
    exact = wire.lossy
    if header.payload_bytes > limit or (exact and header.payload_bytes != limit):
        raise RingRefused(
            "wrong_shape", f"{session.ring_id}: {header.payload_bytes} bytes for {numel} values"
        )
    if len(scratch) < header.payload_bytes:
        scratch.extend(bytes(header.payload_bytes - len(scratch)))
    async with asyncio.timeout(config.step_timeout_s):
        payload = await read_payload_into(reader, scratch, header.payload_bytes)
    try:
        tensor = wire.decode(payload, numel)
    except InvalidMessage as exc:
        raise RingRefused("wrong_shape", f"{session.ring_id}: {exc}") from None
    forward = session.size - 1 <= header.step < session.num_steps - 1
    if forward:  # stored before `accept` wakes the sender's wait for this part
        session.relay[(header.chunk, header.part)] = bytes(payload)
    try:
        session.accept(header.step, header.part, tensor)
    except RingRefused:
        session.relay.pop((header.chunk, header.part), None)
        raise
    session.bytes_received += header.payload_bytes


async def refuse(reader: ByteReader, writer: ByteWriter, exc: InvalidMessage) -> None:
    """Tell the sender why its stream is refused, then let it read that before the stream closes."""
    code = getattr(exc, "code", "invalid_message")
    with contextlib.suppress(*_STREAM_ERRORS, TimeoutError):
        write_error(writer, code, str(exc))
        async with asyncio.timeout(_LINGER_S):
            await writer.drain()
            while await reader.read(1 << 20):  # an honest sender stops and closes once it reads the error
                pass
