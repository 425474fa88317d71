"""The outer optimizer's rounds (`outer.py`): syncs on the rings, and a closing round that may be coded.

A sync is an `Averager` round whose payload is the outer optimizer's (P, or Δ under a ring codec) and
whose result goes through the outer step. The closing round (`wait_for_all`) makes the replicas agree
bit for bit: with a Δ codec it sends Δ + residual under the ring's codec and every member ends at
anchor - Δ̄, which needs equal anchors; rings whose anchors may differ close with a plain fp32 average
(`OuterAverager._closing_kinds`). Without a codec it is the plain average of θ_local, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from torch import Tensor

from ravnest_p2p.averaging.base import RoundMetrics
from ravnest_p2p.averaging.codec_choice import codec_for_rate, ring_rate_mbps
from ravnest_p2p.averaging.outer import OuterOptimizer
from ravnest_p2p.averaging.overlap import Averager, AveragerConfig, ReadFn, WriteFn
from ravnest_p2p.averaging.pseudograd import DeltaCompression
from ravnest_p2p.averaging.ring import RingAllReduce
from ravnest_p2p.averaging.session import LinkRates
from ravnest_p2p.averaging.shards import ShardMap
from ravnest_p2p.utils.aio import run_in_compute_thread

__all__ = ["OuterAverager"]


class OuterAverager(Averager):
    """`Averager` whose rounds are outer-optimizer syncs (same schedule, rings and delayed apply).

    Args:
        outer: this owner's outer state; anchor it (`OuterOptimizer.initialise`) before the first round.
        (the rest as `Averager`.)
    """

    def __init__(
        self,
        config: AveragerConfig,
        rings: RingAllReduce,
        *,
        outer: OuterOptimizer,
        read: ReadFn,
        write: WriteFn,
        shard_map: Callable[[], ShardMap | None],
        link_rates: Callable[[], LinkRates | None] | None = None,
    ) -> None:
        super().__init__(config, rings, read=read, write=write, shard_map=shard_map, link_rates=link_rates)
        self.outer = outer
        self._closing = False
        self.plain_close = False  # a closing round that must be plain (`training/replicas.py`'s fallback)
        self._close_kinds: dict[str, DeltaCompression] = {}  # ring id -> the closing round's codec
        self._lost: dict[str, Tensor] = {}
        self._kind_of: dict[str, DeltaCompression] = {}  # name -> its ring's codec in the latest sync
        self._sent: Mapping[str, Tensor] = {}  # what this sync sent (a late member's own Δ)
        self._late: set[str] = set()  # names whose ring averaged without this member (it was late)
        self.payload_bytes: list[int] = []  # per round: the encoded pseudo-gradients' size

    async def run_round(
        self, round_index: int, *, wait_for_all: bool = False, ring_ids: Collection[str] | None = None
    ) -> RoundMetrics | None:
        """An outer sync, or the closing round (`wait_for_all`; see `_closing_kinds`)."""
        shard_map = self._shard_map()
        self._closing = wait_for_all
        self._close_kinds = {} if shard_map is None or not wait_for_all else self._closing_kinds(shard_map)
        try:
            metrics = await super().run_round(round_index, wait_for_all=wait_for_all, ring_ids=ring_ids)
        finally:
            self._closing = False
        if metrics is None or shard_map is None:
            return metrics
        sizes = {s.ring_id: len(s.ring) for s in shard_map.shards}
        short = frozenset(r.ring_id for r in metrics.rings if len(r.participants) < sizes.get(r.ring_id, 0))
        if not wait_for_all:
            for shard in shard_map.shards:  # a member left out of a sync holds another anchor from now on
                if shard.ring_id in short:
                    self.outer.diverged.update(shard.names)
        elif short and not self.plain_close and self.outer.config.kinds != {DeltaCompression.NONE}:
            # a ring did not close with all its members (anchors that differ, so codecs that differ,
            # or a member died): it closes again, plainly, as round `round_index` + 1 at every member
            self.plain_close = True
            try:
                again = await self.run_round(round_index + 1, wait_for_all=True, ring_ids=short)
            finally:
                self.plain_close = False
            if again is not None:
                metrics = RoundMetrics(
                    round=round_index,
                    time_s=metrics.time_s + again.time_s,
                    bytes_sent=metrics.bytes_sent + again.bytes_sent,
                    bytes_received=metrics.bytes_received + again.bytes_received,
                    rings=[r for r in metrics.rings if r.ring_id not in short] + again.rings,
                )
        return metrics

    def _closing_kinds(self, shard_map: ShardMap) -> dict[str, DeltaCompression]:
        """Ring id -> the closing round's codec: the ring's Δ codec (top-k: int8, a last Δ must arrive
        whole), or none (a plain fp32 average of θ_local) for a ring without a codec, a ring whose
        anchors may differ (a name in `diverged`) or with `plain_close`.

        Why: after the closing round the replicas must agree bit for bit. With a codec every member
        ends at its anchor - Δ̄ (Δ̄: the same bits everywhere), equal only where the anchors are; a
        member a ring once left out holds another anchor, and so, as every member of that ring saw
        the sync without all of them, they all close it plainly. Where members still disagree on a
        ring (a member that missed a sync without knowing), their codecs differ, the ring refuses
        the streams and the caller runs a plain closing round for it (`plain_close`).
        """
        kinds = self._ring_kinds(shard_map)
        out: dict[str, DeltaCompression] = {}
        for shard in shard_map.shards_of(self.rings.peer_id):
            kind = kinds[shard.ring_id]
            if self.plain_close or self.outer.diverged.intersection(shard.names):
                kind = DeltaCompression.NONE
            out[shard.ring_id] = DeltaCompression.INT8 if kind is DeltaCompression.TOPK else kind
        return out

    def _ring_kinds(self, shard_map: ShardMap) -> dict[str, DeltaCompression]:
        """Ring id -> its codec this sync (`codec_choice.py`; the job's `compression` without a table)."""
        c = self.outer.config
        rates = None if self._link_rates is None or not c.codec_by_link_mbps else self._link_rates()
        return {
            s.ring_id: codec_for_rate(c.codec_by_link_mbps, ring_rate_mbps(s.ring, rates), c.compression)
            for s in shard_map.shards_of(self.rings.peer_id)
        }

    async def _all_reduce(
        self,
        shard_map: ShardMap,
        outgoing: Mapping[str, Tensor],
        round_index: int,
        rates: LinkRates | None,
        wait_for_all: bool,
        ring_ids: Collection[str],
    ) -> tuple[dict[str, Tensor], RoundMetrics]:
        kinds = self._close_kinds if self._closing else self._ring_kinds(shard_map)
        # a late member takes the others' step (`OuterOptimizer.step_late`); not with local momentum
        # (its own Δ went through its momentum already) and not in the closing round
        adopt = not (self._closing or self.outer.config.local_momentum)
        averaged, metrics = await self.rings.all_reduce(
            shard_map,
            outgoing,
            round_index=round_index,
            link_rates=rates,
            wait_for_all=wait_for_all or self.outer.config.wait_for_behind,
            ring_ids=ring_ids,
            wire={r: self.outer.wire_of(k) for r, k in kinds.items()},
            errors=None if self._closing else self._lost,
            adopt_late=adopt,
        )
        me = self.rings.peer_id
        late = {r.ring_id for r in metrics.rings if len(r.participants) > 1 and me not in r.participants}
        self._late = {n for s in shard_map.shards if s.ring_id in late for n in s.names}
        return averaged, metrics

    def _by_kind(self, names: Collection[str]) -> dict[DeltaCompression, list[str]]:
        groups: dict[DeltaCompression, list[str]] = {}
        for name in names:
            groups.setdefault(self._kind_of.get(name, self.outer.config.compression), []).append(name)
        return groups

    def _closing_coded(self, names: Collection[str]) -> set[str]:
        """The names of `names` the closing round sends as Δ under a codec."""
        shard_map = self._shard_map()
        if shard_map is None:
            return set()
        coded = {r for r, k in self._close_kinds.items() if k is not DeltaCompression.NONE}
        return {n for s in shard_map.shards if s.ring_id in coded for n in s.names} & set(names)

    async def _outgoing(self, snapshot: dict[str, Tensor]) -> Mapping[str, Tensor]:
        outer = self.outer
        if self._closing:
            coded = self._closing_coded(snapshot)
            if not coded:
                return snapshot
            deltas = await run_in_compute_thread(
                lambda: outer.closing_deltas({n: snapshot[n] for n in coded})
            )
            return {**snapshot, **deltas}
        shard_map = self._shard_map()
        if shard_map is not None:  # the names of this sync only: fragments' syncs may overlap
            kinds = self._ring_kinds(shard_map)
            for shard in shard_map.shards_of(self.rings.peer_id):
                mine = (n for n in shard.names if n in snapshot)
                self._kind_of.update(dict.fromkeys(mine, kinds[shard.ring_id]))
        for name in snapshot:
            self._lost.pop(name, None)

        def encode() -> tuple[dict[str, Tensor], int]:  # on the compute thread: no other sync between
            out: dict[str, Tensor] = {}
            nbytes = 0
            for kind, names in self._by_kind(snapshot).items():
                part = {n: snapshot[n] for n in names}
                if kind is DeltaCompression.NONE:
                    out.update(outer.outgoing(part, kind))
                else:
                    out.update(outer.outgoing_deltas(part, kind))
                nbytes += outer.payload_bytes
            return out, nbytes

        out, nbytes = await run_in_compute_thread(encode)
        self.payload_bytes.append(nbytes)
        self._sent = out
        return out

    async def _incoming(self, averaged: dict[str, Tensor]) -> dict[str, Tensor]:
        outer = self.outer
        if self._closing:
            coded = self._closing_coded(averaged)
            if not coded:
                return averaged
            final = await run_in_compute_thread(lambda: outer.close({n: averaged[n] for n in coded}))
            return {**averaged, **final}

        late, sent = self._late, self._sent
        self._late, self._sent = set(), {}

        def step() -> dict[str, Tensor]:
            out: dict[str, Tensor] = {}
            for kind, names in self._by_kind(averaged).items():
                part = {n: averaged[n] for n in names if n not in late}
                left_out = {n: averaged[n] for n in names if n in late}
                if left_out:
                    out.update(outer.step_late(left_out, sent, kind))
                if kind is DeltaCompression.NONE:
                    out.update(outer.step(part))
                else:
                    lost = {n: self._lost.pop(n) for n in names if n in self._lost}
                    out.update(outer.step_deltas(part, lost))
            return out

        return await run_in_compute_thread(step)
