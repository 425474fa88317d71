"""Multi-ring all-reduce over raw libp2p streams: every shard's owners average it, all rings at once.

Problem. Replicas of a model, split differently into stages, must be averaged across clusters with no
coordinator, over links of a few MB/s, while some members die or stall.

Algorithm. Each shard of the `ShardMap` is averaged by its own ring (Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009: reduce-scatter + all-gather,
2(C-1)/C of the data per member, the bandwidth lower bound). A peer runs the rings of all its shards
concurrently (`asyncio.gather`), so a stage owner's upload is busy with every shard at once. Parts are
pipelined (see `session.py`): part p of step t leaves as soon as part p of step t-1 arrived, so after the
first part the link never idles. Optional lossy compression (fp16, ...) applies to every part; with it,
the owner of a reduced chunk keeps the decoded (compressed) copy so that every replica ends with
bit-identical values.

Data plane (`ring_io.py`, `partstream.py`, `frames.py`, `streams.py`). Each member opens two libp2p
streams per ring and attempt to its right neighbour (one stream's flow-control window in the daemons
capped the link; see `partstream.py`), while it flattens the shard, and deals its parts over them: a
20-byte header and the part's raw fp32 (or fp16) bytes straight from the flat accumulator; the receiver
checks the header against its session before reading the payload, reads it into a reused buffer, checks
it (shape, finite) and adds it in place; a 7-byte ack per part tells the sender it was taken. Only the
liveness probe is an RPC. The first version sent each part as an RPC over a fresh stream (msgpack
envelope, protobuf tensor): 64 MiB among 4 loopback processes took 2.86 s/round against hivemind's
averager's 1.91 s; with this plane ~1.2-1.5 s. Parts are 256 KiB: a pipeline message sharing the uplink
waits behind at most one part (84 ms at 25 Mbit/s).

Measured on the lab (benchmarks/results/averaging_lab.md; 64 MB, 4 peers, TCP Reno, a warm-up round
apart), history in short: 4 x 100 Mbit/s, one stream per neighbour, 8.93 s/round (0.86 of the 7.68 s
bound 2(C-1)/C*S/B) against hivemind's 8.74 s. `ss -ti` in the namespaces then showed the sender's
unacked segments capped at ~225-270 with a congestion window of ~700 and no losses: the stream's window,
not the link. Two streams per neighbour: 8.28 s (0.93 of the bound, 0.97 of the TCP payload bound; 0.94x
hivemind's 8.82 s in the same run); three or four: no better. Heterogeneous links (25/50/100/200): equal
chunks make every member move 2(C-1)/C of the shard through the 25 Mbit/s link; given the members' link
rates (`all_reduce(..., link_rates=)`), chunks are sized by rate (`weights.py`: member i sends
2S - c[i+1] - c[i+2], so the slow member's traffic drops to S): 26-27 s against hivemind's 35 s. The 25
Mbit/s member, receiving and sending at once, uploads below its payload rate (its own TCP acks queue
behind its parts); pacing each stream to 0.92 of its link (`RingConfig.pace_fraction`, opt-in, needs
trustworthy rates) keeps that queue short: 23.7 s, but costs the cap at uniform rates (8.85 s).
Rejected: two rings running in opposite directions over the shard's halves (10.1-10.3 s: the two flows
sharing an uplink got unequal shares and each half-ring runs at its slowest link's pace); an
application window on unacknowledged parts (2-8 parts: within noise); larger parts.

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
partitioned member costs its own averaging, never the others' training. A closing round
(`wait_for_all`, after which the replicas must agree) also waits for members that answer the probe as
*behind* (in this epoch's ring, not in the round yet: their cluster is still finishing its last steps),
re-probing them until they arrive or the round deadline is near; a periodic round does not wait.

Alternatives rejected. Resuming from partial sums after a failure (saves a restart) needs every
survivor to agree on which parts of the dead member were already folded in, i.e. a consensus per part;
restarting costs one more pass over the shard only when someone fails. hivemind's averager forms groups
by DHT matchmaking and splits by peer bandwidth; our rings are fixed by the plan and need no matchmaking.

Commit (`commit.py`). An attempt's mean counts as soon as one member holds it whole: a member whose
attempt failed with every part in hand (only its neighbour's acks missing) applies it, and one that
lacks it fetches it from a holder its probe finds, instead of forming the next attempt; so every
survivor applies the same mean. With `adopt_late` (outer syncs) a member left out of the attempt that
committed fetches its mean too, and takes the same outer step as the others.

Limits. Probes decide liveness, not speed: a member that answers probes but moves slower than the step
deadline is dropped only after its attempt fails `max_attempts` times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping

import torch

from ravnest_p2p.averaging.base import RingConfig, RingMetrics, RoundMetrics, flatten_shard, split_shard
from ravnest_p2p.averaging.commit import fetch_result
from ravnest_p2p.averaging.deltawire import WireCodec
from ravnest_p2p.averaging.early import AllowEarly, EarlySlots
from ravnest_p2p.averaging.frames import ByteReader, ByteWriter
from ravnest_p2p.averaging.messages import RING_RESULT, RING_STATUS
from ravnest_p2p.averaging.partstream import AttemptFailed
from ravnest_p2p.averaging.reform import reform
from ravnest_p2p.averaging.ring_io import RingIO
from ravnest_p2p.averaging.session import LinkRates, RingSession
from ravnest_p2p.averaging.shards import Shard, ShardMap
from ravnest_p2p.averaging.streams import P2PStreams, Streams
from ravnest_p2p.transport import P2PTransport, RpcEndpoint

__all__ = ["RingAllReduce"]

logger = logging.getLogger(__name__)

_UNSERVE_TIMEOUT_S = 5.0


class RingAllReduce(RingIO):
    """Serves the ring's part streams and `ring_status`, and runs this peer's rings.

    Args:
        endpoint: the peer's RPC endpoint (its namespace is the run id); carries the probes.
        config: deadlines, part size, compression.
        streams: where part streams are opened and served; by default the daemon of the endpoint's
            `P2PTransport` (pass a `MemoryStreamHub`'s streams with a fake transport).
        allow_early: who may wait for a ring this member does not know yet (see `early.py`); rings it
            knows (`expect`, or its last round's map) admit their members only.
    """

    def __init__(
        self,
        endpoint: RpcEndpoint,
        config: RingConfig | None = None,
        *,
        streams: Streams | None = None,
        allow_early: AllowEarly | None = None,
    ) -> None:
        if streams is None:
            if not isinstance(endpoint.transport, P2PTransport):
                raise ValueError("streams= is required unless the endpoint's transport is a P2PTransport")
            streams = P2PStreams(endpoint.transport)
        self.endpoint = endpoint
        self.config = config or RingConfig()
        self._streams = streams
        self._stream_name = f"ravnest/{endpoint.namespace}/ring_parts"
        self._sessions: dict[str, RingSession] = {}
        self._changed = asyncio.Event()
        self.early = EarlySlots(self.config.max_buffered_messages, allow_early)
        self._serving = False
        self._expected: ShardMap | None = None  # the map of the coming (or running) round
        self._releases: dict[str, asyncio.TimerHandle] = {}  # held means' expiry (`commit.py`)

    @property
    def peer_id(self) -> str:
        return self.endpoint.peer_id

    async def start(self) -> None:
        await self._streams.serve(self._stream_name, self._on_stream)
        await self.endpoint.serve(RING_STATUS, self._on_status)
        await self.endpoint.serve(RING_RESULT, self._on_result)
        self._serving = True

    async def aclose(self) -> None:
        if self._serving:
            self._serving = False
            try:
                async with asyncio.timeout(_UNSERVE_TIMEOUT_S):  # a dead daemon must not hang shutdown
                    await self._streams.unserve(self._stream_name)
                    await self.endpoint.unserve(RING_STATUS)
                    await self.endpoint.unserve(RING_RESULT)
            except TimeoutError:
                logger.warning("ring handlers of %s not removed in %ss", self.peer_id, _UNSERVE_TIMEOUT_S)
        for session in self._sessions.values():
            session.stop_attempt()
        for release in self._releases.values():
            release.cancel()
        self._releases.clear()
        self._notify()

    def expect(self, shard_map: ShardMap) -> None:
        """Admit early streams of `shard_map`'s rings from their members only (call before a round)."""
        self.early.expect(shard_map)
        self._expected = shard_map

    async def __aenter__(self) -> RingAllReduce:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ----- one round over all my rings -----------------------------------------------------------
    async def all_reduce(
        self,
        shard_map: ShardMap,
        tensors: Mapping[str, torch.Tensor],
        *,
        round_index: int,
        link_rates: LinkRates | None = None,
        wait_for_all: bool = False,
        wire: WireCodec | Mapping[str, WireCodec | None] | None = None,
        errors: dict[str, torch.Tensor] | None = None,
        ring_ids: Collection[str] | None = None,
        adopt_late: bool = False,
    ) -> tuple[dict[str, torch.Tensor], RoundMetrics]:
        """Average every shard this peer owns with the other owners; all rings run concurrently.

        Args:
            shard_map: this epoch's map (same at every peer).
            tensors: at least every name of every shard this peer owns (a snapshot: not modified).
            round_index: the round number, the same at every member of a ring.
            link_rates: peer id -> (upload, download) rate of (at least) every member of my rings, the
                same figures at every member (e.g. the agreed plan's): chunks are then sized by rate
                when `config.weighted_chunks` (`weights.py`). None = equal chunks. Members given
                different rates refuse each other's streams.
            wait_for_all: a member that answers that it has not reached this round yet (but will: it
                is in this epoch's ring) is waited for, up to the round deadline, instead of being left
                out of the next attempt. For a closing round, after which the replicas must agree.
            wire: the parts carry encoded Δ (`deltawire.py`) instead of `config.compression`; every
                member of a ring must pass the same codec (streams say which; others are refused).
                A mapping gives each ring id its own (missing or None: `config.compression`).
            errors: with a lossy `wire`, filled with what this member's encodings dropped, by name, in
                sum units (x ring size of the mean), for the rings that averaged: error feedback.
            ring_ids: average only these of my rings (a staggered sync's fragment); None = all.
            adopt_late: if the others average a ring without this member (it was late), fetch their
                mean (`commit.py`); that ring's participants then do not include this peer.

        Returns:
            The averaged tensors (same names, shapes and dtypes) and this round's metrics. A ring that
            could not complete returns the local values, with only this peer as participant.

        Raises:
            ValueError: a name of one of my shards is missing or has the wrong size.
        """
        started = time.monotonic()
        self.expect(shard_map)
        rates = link_rates if self.config.weighted_chunks else None
        shards = [s for s in shard_map.shards_of(self.peer_id) if ring_ids is None or s.ring_id in ring_ids]
        for shard in shards:
            for name, numel in zip(shard.names, shard.numels, strict=True):
                if name not in tensors or tensors[name].numel() != numel:
                    raise ValueError(f"{name!r}: missing or not {numel} elements")
        results = await asyncio.gather(
            *(
                self._run_ring(
                    shard_map.epoch,
                    shard,
                    tensors,
                    round_index,
                    rates,
                    wait_for_all,
                    wire.get(shard.ring_id) if isinstance(wire, Mapping) else wire,
                    adopt_late,
                )
                for shard in shards
            )
        )
        averaged: dict[str, torch.Tensor] = {}
        for named, _, lost in results:
            averaged.update(named)
            if errors is not None and lost is not None:
                errors.update(lost)
        rings = [m for _, m, _ in results]
        metrics = RoundMetrics(
            round=round_index,
            time_s=time.monotonic() - started,
            bytes_sent=sum(r.bytes_sent for r in rings),
            bytes_received=sum(r.bytes_received for r in rings),
            rings=rings,
        )
        return averaged, metrics

    async def _run_ring(
        self,
        epoch: int,
        shard: Shard,
        tensors: Mapping[str, torch.Tensor],
        round_index: int,
        link_rates: LinkRates | None,
        wait_for_all: bool = False,
        wire: WireCodec | None = None,
        adopt_late: bool = False,
    ) -> tuple[dict[str, torch.Tensor], RingMetrics, dict[str, torch.Tensor] | None]:
        started = time.monotonic()
        parts = [tensors[n] for n in shard.names]
        session = RingSession(
            ring_id=shard.ring_id,
            epoch=epoch,
            round_index=round_index,
            me=self.peer_id,
            numel=shard.numel,
            part_numel=max(1, self.config.part_size_bytes // 4),
            link_rates=link_rates,
            wire=wire,
        )
        session.ring = shard.ring
        deadline = time.monotonic() + self.config.round_timeout_s
        members: tuple[str, ...] | None = shard.ring
        attempt = 0
        result: torch.Tensor | None = None
        participants: tuple[str, ...] = (self.peer_id,)
        late = False  # the mean of an attempt made without this member (`adopt_late`)
        # The first attempt's streams open while the shard is flattened: both take tens of ms per
        # round (64 MB: ~30 ms to flatten, a stream negotiation through both daemons), in series they
        # delayed every member's first byte by ~0.15 s on the lab.
        me = shard.ring.index(self.peer_id)
        early = asyncio.create_task(
            self._open(shard.ring[(me + 1) % len(shard.ring)]), name=f"open:{shard.ring_id}"
        )
        try:
            values = await flatten_shard(parts, shard.numel)
            self._release(shard.ring_id)  # the previous round's mean: its members have moved on
            self._sessions[shard.ring_id] = session
            self._notify()
            while members is not None and len(members) >= 2:
                if attempt > 0:  # the failed attempt summed into `values`: start again from `tensors`
                    values = await flatten_shard(parts, shard.numel)
                session.start_attempt(attempt, members, values)
                self._notify()
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        await self._attempt(session, early if attempt == 0 else None)
                    result, participants = session.average(), session.members
                    break
                except (AttemptFailed, TimeoutError) as exc:
                    session.stop_attempt()
                    self._notify()
                    logger.info(
                        "ring %s round %d attempt %d failed: %s", shard.ring_id, round_index, attempt, exc
                    )
                    if session.complete:  # only acks were missing: the mean is here (`commit.py`)
                        result, participants = session.average(), session.members
                        break
                    last = attempt + 1 >= self.config.max_attempts or time.monotonic() >= deadline
                    # even without attempts left: a member that holds this attempt's mean commits it
                    probe_by = max(deadline, time.monotonic() + self.config.probe_timeout_s)
                    after = await reform(
                        self.endpoint,
                        session,
                        self.config,
                        probe_by,
                        wait_for_all=wait_for_all and not last,
                        adopt_late=adopt_late,
                    )
                    if after.holders:
                        mean = await fetch_result(
                            self.endpoint, session, after.holders, self.config, attempt=after.attempt
                        )
                        if mean is not None and after.late:
                            result, participants, late = mean, after.members or (), True
                        elif mean is not None:
                            result, participants = session.adopt(mean), session.members
                        members = None
                        break
                    if last:
                        members = None
                        break
                    attempt, members = after.attempt, after.members
        finally:
            session.finish(done=True)
            self._notify()
            await _discard(early)
            self._linger(session)
        lost = None
        if result is None:  # no attempt completed: this round keeps the local values
            result = await flatten_shard(parts, shard.numel)
        elif session.errors.numel() and not late:  # a late member's encodings are in no mean
            lost = await split_shard(session.errors, shard, tensors)
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
        return named, metrics, lost


async def _discard(opening: asyncio.Task[list[tuple[ByteReader, ByteWriter]]]) -> None:
    """Cancel a stream opening that no attempt took, or close the streams it opened (idempotent)."""
    opening.cancel()
    (done,) = await asyncio.gather(opening, return_exceptions=True)
    if isinstance(done, list):
        for _, writer in done:
            writer.close()
