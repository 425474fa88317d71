"""One member's state for one ring in one round: chunk arithmetic, the accumulator, message checks.

Ring all-reduce (Patarasuk & Yuan 2009) over C members: the shard's flat vector is cut into C chunks.
Reduce-scatter, steps t = 0..C-2: member i sends chunk (i - t) mod C to its right neighbour and adds the
chunk (i - t - 1) mod C it receives from its left one; after C-1 steps member i holds the full sum of
chunk (i + 1) mod C. All-gather, steps g = 0..C-2 (t = C-1+g): member i forwards chunk (i + 1 - g) mod C
and stores the chunk (i - g) mod C it receives. Each member sends and receives 2(C-1)/C of the shard,
which is optimal for a bandwidth-bound all-reduce.

Chunks are equal by default. Given each member's link rates (the same figures at every member, e.g.
from the agreed plan), `weights.py` sizes them so that slow links carry less; the element boundaries
then depend on the rates, so their digest travels in every stream's hello and members that computed
different boundaries refuse each other (`chunks_mismatch`) instead of mixing parts.

Chunks are further cut into parts of a fixed size; part p of step t can be sent as soon as part p of
step t-1 arrived, so parts of consecutive steps overlap (pipelining) and no member waits for a whole
chunk. Within an attempt, arrivals never depend on order: reduce arrivals touch a chunk nobody reads
until the next step, gather arrivals one already sent.

Everything a stream and its parts claim is checked against this session before the accumulator is
touched: the stream's hello once (epoch, attempt, membership digest, that the sender is the left
neighbour), each part's header before its payload is read (step, chunk, part, duplicates; the payload
size from the part's bounds), the payload after it is read (dtype, shape, finite values).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Mapping, Sequence
from enum import StrEnum

import torch

from ravnest_p2p.averaging.deltawire import WireCodec
from ravnest_p2p.averaging.messages import StreamHello
from ravnest_p2p.averaging.weights import chunk_bounds, equal_bounds
from ravnest_p2p.errors import InvalidMessage, StaleEpoch
from ravnest_p2p.transport import Compression

__all__ = [
    "LinkRates",
    "Phase",
    "RingRefused",
    "RingSession",
    "bounds_digest",
    "members_digest",
    "wire_bytes",
]

LinkRates = Mapping[str, tuple[float, float]]
"""Peer id -> (upload, download) rate: any unit common to all members for chunk sizes; payload bytes/s
if the ring paces its sends (`RingConfig.pace_fraction`)."""

_BYTES_PER_ELEMENT = {
    Compression.NONE: 4,
    Compression.FP16: 2,
    Compression.MEANSTD16: 2,
    Compression.UNIFORM8BIT: 1,
    Compression.QUANTILE8BIT: 1,
}


def wire_bytes(numel: int, compression: Compression) -> int:
    """Payload bytes of `numel` fp32 elements under `compression` (headers excluded)."""
    return numel * _BYTES_PER_ELEMENT[compression]


def members_digest(members: Sequence[str]) -> str:
    return hashlib.sha256("\x1f".join(members).encode()).hexdigest()[:16]


def bounds_digest(bounds: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, bounds)).encode()).hexdigest()[:16]


class Phase(StrEnum):
    REDUCE = "reduce"
    GATHER = "gather"


class RingRefused(InvalidMessage):
    """A ring message does not match the receiver's session; the reply carries `code`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RingSession:
    """State of one ring at one member for one round (across its attempts).

    Args:
        ring_id: the shard's ring id.
        epoch: plan epoch.
        round_index: averaging round.
        me: this member's peer id.
        numel: elements in the shard.
        part_numel: elements per part.
        link_rates: every member's (upload, download) rate, for chunks sized by rate; None (or a
            member missing) = equal chunks. Must be the same at every member.
        wire: parts carry encoded Δ (`deltawire.py`) instead of `RingConfig.compression`; with a lossy
            one, `errors` collects what this member's encodings dropped (in sum units).
    """

    def __init__(
        self,
        *,
        ring_id: str,
        epoch: int,
        round_index: int,
        me: str,
        numel: int,
        part_numel: int,
        link_rates: LinkRates | None = None,
        wire: WireCodec | None = None,
    ) -> None:
        assert part_numel > 0
        self.ring_id = ring_id
        self.epoch = epoch
        self.round = round_index
        self.me = me
        self.numel = numel
        self.part_numel = part_numel
        self.link_rates = link_rates
        self.wire = wire
        self.errors = torch.empty(0)  # lossy wire: this attempt's rounding losses, per element
        self.relay: dict[tuple[int, int], bytes] = {}  # wire: gathered parts' bytes, forwarded verbatim
        self.attempt = -1
        self.members: tuple[str, ...] = ()
        self.ring: tuple[str, ...] = ()  # the shard's whole ring (the plan's), set by its runner
        self.digest = ""
        self.chunks_digest = ""
        self.running = False
        self.done = False
        self.acc = torch.empty(0)
        # the mean of attempt `result_attempt` once this member holds it whole (`commit.py`): kept after
        # the round, for members of that attempt that fetch it
        self.result: torch.Tensor | None = None
        self.result_attempt = -1
        self.bytes_sent = 0
        self.bytes_received = 0
        self._received: dict[tuple[int, int], asyncio.Future[bool]] = {}
        self._bounds: list[int] = []

    # ----- attempts ------------------------------------------------------------------------------
    def start_attempt(self, attempt: int, members: Sequence[str], values: torch.Tensor) -> None:
        """Begin `attempt` among `members` (ring order) from this member's original flat fp32 `values`.

        `values` becomes the accumulator and is modified: pass a fresh copy for every attempt (the
        first attempt takes the flattened shard as is, so a round that succeeds copies it only once).
        """
        assert self.me in members
        assert len(members) >= 2
        assert values.numel() == self.numel
        self.attempt = attempt
        self.members = tuple(members)
        self.digest = members_digest(self.members)
        self._bounds = self._chunk_bounds()
        weighted = self._bounds != equal_bounds(self.numel, self.size)
        self.chunks_digest = bounds_digest(self._bounds) if weighted else ""  # "": equal chunks
        self.acc = values
        self.errors = torch.zeros(self.numel) if self.wire is not None and self.wire.lossy else torch.empty(0)
        self.relay = {}
        loop = asyncio.get_running_loop()
        self._received = {
            (t, p): loop.create_future()
            for t in range(self.num_steps)
            for p in range(self.num_parts(self.recv_chunk(t)))
        }
        self.running = True

    def _chunk_bounds(self) -> list[int]:
        n, rates = self.numel, self.link_rates
        if rates is None or any(m not in rates for m in self.members):
            return equal_bounds(n, self.size)
        return chunk_bounds(
            n, [rates[m][0] for m in self.members], download=[rates[m][1] for m in self.members]
        )

    def link_rate(self) -> float | None:
        """min(my upload, my right neighbour's download) from the link rates, or None if unknown."""
        rates = self.link_rates
        if rates is None or self.me not in rates or self.right not in rates:
            return None
        rate = min(rates[self.me][0], rates[self.right][1])
        return rate if math.isfinite(rate) and rate > 0 else None

    def stop_attempt(self) -> None:
        """Abort the current attempt: every waiter wakes up with `False`."""
        self.running = False
        for fut in self._received.values():
            if not fut.done():
                fut.set_result(False)

    def finish(self, *, done: bool) -> None:
        self.stop_attempt()
        self.done = done
        self.acc = torch.empty(0)  # late messages are refused; free the memory (`result` stays)
        self.relay = {}

    @property
    def complete(self) -> bool:
        """Every part of the current attempt arrived: the accumulator holds the whole sum.

        True even if the attempt then failed (only the right neighbour's acks were missing). Frozen
        once the attempt stops: a stopped attempt takes no more parts.
        """
        received = self._received.values()
        return bool(received) and all(f.done() and f.result() for f in received)

    @property
    def holds(self) -> int:
        """The attempt whose whole mean this member holds or is about to hold (`commit.py`), else -1."""
        if self.result is not None:
            return self.result_attempt
        return self.attempt if self.complete and self.acc.numel() else -1

    def adopt(self, mean: torch.Tensor) -> torch.Tensor:
        """Take `mean` as the result of the current attempt (fetched from a member that holds it)."""
        self.result, self.result_attempt = mean, self.attempt
        return mean

    def release(self) -> None:
        """Forget the held result (no member can still need it)."""
        self.result, self.result_attempt = None, -1

    # ----- chunk arithmetic ----------------------------------------------------------------------
    @property
    def bounds(self) -> tuple[int, ...]:
        """This attempt's chunk boundaries: chunk k is elements [bounds[k], bounds[k + 1])."""
        return tuple(self._bounds)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def position(self) -> int:
        return self.members.index(self.me)

    @property
    def right(self) -> str:
        return self.members[(self.position + 1) % self.size]

    @property
    def left(self) -> str:
        return self.members[(self.position - 1) % self.size]

    @property
    def num_steps(self) -> int:
        return 2 * (self.size - 1)

    def phase(self, step: int) -> Phase:
        return Phase.REDUCE if step < self.size - 1 else Phase.GATHER

    def send_chunk(self, step: int) -> int:
        i, c = self.position, self.size
        return (i - step) % c if step < c - 1 else (i + 1 - (step - (c - 1))) % c

    def recv_chunk(self, step: int) -> int:
        i, c = self.position, self.size
        return (i - step - 1) % c if step < c - 1 else (i - (step - (c - 1))) % c

    def num_parts(self, chunk: int) -> int:
        length = self._bounds[chunk + 1] - self._bounds[chunk]
        return -(-length // self.part_numel)

    def part_bounds(self, chunk: int, part: int) -> tuple[int, int]:
        start = self._bounds[chunk] + part * self.part_numel
        return start, min(start + self.part_numel, self._bounds[chunk + 1])

    # ----- receiving -----------------------------------------------------------------------------
    async def wait_received(self, step: int, part: int, timeout_s: float) -> bool:
        """Wait until part `part` of step `step` arrived; False if the attempt stopped or time ran out."""
        fut = self._received[(step, part)]
        if fut.done():
            return fut.result()
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            return False

    def check_stream(self, hello: StreamHello, sender: str) -> None:
        """Check a stream's hello against this attempt (epoch, attempt, members, left neighbour).

        Raises:
            RingRefused / StaleEpoch: the stream does not belong to this attempt.
        """
        if hello.epoch != self.epoch:
            raise StaleEpoch(f"{self.ring_id}: epoch {hello.epoch}, expected {self.epoch}")
        if not self.running or hello.attempt != self.attempt:
            raise RingRefused("not_running", f"{self.ring_id}: attempt {hello.attempt} is not running")
        if hello.members_digest != self.digest:
            raise RingRefused("membership_mismatch", f"{self.ring_id}: ring members differ")
        if hello.codec != ("" if self.wire is None else self.wire.label):
            raise RingRefused("wrong_codec", f"{self.ring_id}: codec {hello.codec!r} differs")
        if hello.chunks_digest != self.chunks_digest:
            raise RingRefused("chunks_mismatch", f"{self.ring_id}: chunk boundaries differ (link rates?)")
        if sender != self.left:
            raise RingRefused("wrong_sender", f"{self.ring_id}: {sender} is not the left neighbour")

    def expect(self, attempt: int, step: int, chunk: int, part: int) -> tuple[int, int]:
        """Check a part header of `attempt` before its payload is read; return the part's bounds.

        Raises:
            RingRefused: the attempt is over, or step, chunk or part is not one this member awaits.
        """
        if not self.running or attempt != self.attempt:
            raise RingRefused("not_running", f"{self.ring_id}: attempt {attempt} is not running")
        if not 0 <= step < self.num_steps:
            raise RingRefused("wrong_step", f"{self.ring_id}: no step {step}")
        if chunk != self.recv_chunk(step):
            raise RingRefused("wrong_chunk", f"{self.ring_id}: chunk {chunk} at step {step}")
        fut = self._received.get((step, part))
        if fut is None:
            raise RingRefused("wrong_part", f"{self.ring_id}: no part {part} in chunk {chunk}")
        if fut.done():
            raise RingRefused("duplicate", f"{self.ring_id}: part {part} of step {step} already arrived")
        return self.part_bounds(chunk, part)

    def accept(self, step: int, part: int, tensor: torch.Tensor) -> None:
        """Add (reduce) or store (gather) a part that `expect` admitted and the codec checked (finite).

        Raises:
            RingRefused: the attempt stopped meanwhile, or the tensor has the wrong dtype or shape;
                nothing was changed.
        """
        fut = self._received.get((step, part))
        if not self.running or fut is None or fut.done():
            raise RingRefused("not_running", f"{self.ring_id}: part {part} of step {step} no longer awaited")
        lo, hi = self.part_bounds(self.recv_chunk(step), part)
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != (hi - lo,):
            raise RingRefused(
                "wrong_shape", f"{self.ring_id}: got {tensor.dtype} {tuple(tensor.shape)}, want ({hi - lo},)"
            )
        if self.phase(step) is Phase.REDUCE:
            self.acc[lo:hi] += tensor
        else:
            self.acc[lo:hi] = tensor
        fut.set_result(True)

    def average(self) -> torch.Tensor:
        """The mean over this attempt's members once `complete`, in place (acc is ours); held for fetches."""
        return self.adopt(self.acc.div_(self.size))
