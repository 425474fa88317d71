"""An outer optimizer across clusters (DiLoCo): average pseudo-gradients, step a shared anchor.

Problem. Averaging the replicas' parameters every few steps (`overlap.py`) moves the whole model per
round; across slow links the bytes, not the compute, set the pace. DiLoCo (Douillard et al., arXiv
2311.08105) syncs every H inner steps and treats the replicas' drift as a gradient: each replica computes
the pseudo-gradient Δ = θ_outer - θ_local, the replicas average it, and an outer SGD with Nesterov
momentum (lr 0.7, momentum 0.9 in the paper) steps the shared anchor θ_outer; training continues from it.
At H = 500 it matched synchronous training with ~500x less communication.

How it maps here. Every stage owner keeps, for the floating parameters it owns, θ_outer, the momentum
buffer and (with compression) the error-feedback residual (`OuterOptimizer`). A sync is one delayed
averaging round (`Averager`, unchanged ring protocol) whose payload is the proposal
P = θ_outer - Δ̂ instead of θ_local, where Δ̂ is Δ (+ residual) after compression (`pseudograd.py`);
uncompressed, P is θ_local itself. The ring returns P̄ = θ_outer - mean(Δ̂) (θ_outer is the same at
every replica), so Δ̄ = θ_outer - P̄, and the outer step is written relative to P̄:

    buf ← μ·buf + Δ̄;   u = Δ̄ + μ·buf (Nesterov) or buf;   θ_outer ← P̄ + (Δ̄ - lr·u)

which is θ_outer - lr·u. With lr = 1 and μ = 0 the correction is exactly zero and is not added, so the
step *is* the ring's average, bit for bit: plain averaging (test). The new θ_outer is applied as delayed
averaging applies θ̄: θ_local ← θ_outer + (θ_now - θ_snapshot). Every replica computes the step from the
same P̄ and the same (θ_outer, buf), so their anchors stay bit-identical (test: equal digests).

Why average P rather than Δ: it makes the lr = 1, μ = 0 case the existing average exactly (averaging Δ
and subtracting from θ_outer rounds differently), and the ring's fp32 sum costs Δ̄ only ~1 ulp of θ.
Do not combine the outer optimizer with the ring's own lossy `compression` (fp16 of P is ~1e-3 of θ,
far more than a small Δ): compress Δ here instead.

Compressed Δ travels encoded (`deltawire.py`). With a codec the rings average Δ itself, not P: each
member hands the ring c = Δ + residual (top-k: its kept entries, the rest into the residual), the ring
re-quantises at every hop (int8/int4) or sums sparse parts exactly (top-k), and returns the same Δ̄
bits to every member; the step is then θ_outer ← θ_outer - lr·u. What the ring's roundings at this
member dropped (`RingAllReduce.all_reduce(errors=)`) is its next residual, so the sum over members
and syncs loses nothing for good. Buffers then get an anchor too and take anchor - Δ̄ (the ring carries
only Δ, and a running mean quantised as an absolute value would swamp the Δ sharing its block).

Buffers (BatchNorm statistics) are not parameters: they are averaged plainly (P = θ_local, θ ← P̄),
never stepped with momentum (an overshoot could make a running variance negative).

Faults (the rule the docs state). A member the others left out of a ring because it was late fetches
their mean and takes the same outer step (`OuterOptimizer.step_late`: anchors and momentum stay
bit-identical); its own Δ is in no mean and goes into its next sync (it continues from the new anchor
less its Δ). A shard whose ring did not average at all this round (this owner was alone: its partners
died; or it was later than the holders keep the mean) takes no outer step: θ_outer, momentum and
residual stay as they were, and θ_local is not reset, so its progress is in its next Δ. Every survivor
of a ring attempt applies the same mean or none does (the ring's commit rule, `commit.py`). A member
left alone (or cut off) then holds an older anchor than the others; it re-converges (the difference
contracts by ~0.5 per sync at lr 0.7, μ 0.9) but is not bit-identical again until a state transfer.
The closing round (`wait_for_all`, `outer_averager.py`) must leave the replicas bit-identical. Without a
Δ codec it is a plain fp32 average of θ_local. With one it sends Δ + residual (the residual folded in,
so nothing compression held back is lost at the end) under the ring's codec (top-k rings: int8) and
every member ends at anchor - Δ̄: ~8x fewer bytes in int4, identical wherever the anchors are. The
names of a ring that once synced without all its members are in `diverged` at every member that saw
it (conservative: a member left alone holds another anchor, a late member that took the others' step
does not): those rings close plainly; if members disagree (one missed a sync unknowingly) their codecs
differ, the ring refuses the streams, and every member closes that ring again plainly (round index +
1). Imported outer state counts as diverged.

Re-plan. The state is keyed by global parameter name, like `training/stage_state.py`: `export_state`
gives ``outer/<name>/<slot>`` tensors, `import_state` takes them (any subset; a new owner of some layers
takes those layers' entries from their old owners). The hand-over and the checkpoints carry them with
the stage (`stage_state.attach_extra_state`); a name with no imported anchor starts from the stage's
weights when the averager starts. Codec per ring: `codec_choice.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from ravnest_p2p.averaging.deltawire import WireCodec
from ravnest_p2p.averaging.pseudograd import DeltaCompression, compress, encoded_bytes

__all__ = ["OUTER_PREFIX", "OUTER_SLOTS", "OuterOptimizer", "OuterOptimizerConfig"]

logger = logging.getLogger(__name__)

OUTER_PREFIX = "outer/"
OUTER_SLOTS = ("theta", "momentum", "residual")
_SLOTS = OUTER_SLOTS


class OuterOptimizerConfig(BaseModel):
    """The outer step and the pseudo-gradient's compression (the sync period is the job's).

    Attributes:
        lr: outer learning rate (DiLoCo: 0.7).
        momentum: outer momentum (DiLoCo: 0.9); 0 disables the buffer.
        nesterov: Nesterov momentum (DiLoCo) or classic heavy ball.
        compression: ``none``, ``int8``, ``int4`` (per-chunk scale) or ``topk``.
        chunk_numel: elements per quantisation scale.
        topk_fraction: share of entries ``topk`` keeps.
        topk_chunk: ``topk`` keeps its share in every chunk of this many elements (0: per tensor).
        topk_bits: bits per kept ``topk`` value (32: fp32; 2-8: sign + magnitude level per chunk).
        error_feedback: keep what compression drops and add it to the next Δ.
        local_momentum: each replica keeps the momentum of its own Δ and compresses the momentum's
            (Nesterov) update instead of Δ; the outer step is then θ_outer - lr x the ring's mean
            (DGC's momentum correction, Lin et al. 2018). Uncompressed it is the same step as the
            outer momentum (the mean of the replicas' buffers is the buffer of the means); with top-k,
            what is not sent waits in the residual instead of being amplified by a shared buffer.
        unsent_stays_local: what compression left out stays in this replica's weights: after a sync it
            continues from θ_outer - residual (not θ_outer), so its next Δ already holds the residual,
            which is then not added again. Restarting from θ_outer instead makes inner training redo
            the unsent progress every sync while the residual also keeps it: counted twice and more.
            The anchors stay identical; the replicas' weights differ by their residuals until the
            closing plain average.
        residual_decay: the residual is scaled by this before it is added to the next Δ (SparseLoCo's
            error-feedback decay β; 1 keeps it all).
        num_fragments: staggered syncs (Streaming DiLoCo, `stagger.py`): the shards are split into
            this many fragments, each syncing every H steps, one every H / num_fragments steps.
        codec_by_link_mbps: (below_mbps, codec) rows, rates increasing: a ring whose slowest link is
            below a row's rate uses the first such row's codec instead of `compression`
            (`codec_choice.py`; needs the agreed plan's link rates).
        wait_for_behind: a sync waits, up to the ring's round deadline, for members that answer they
            have not reached it yet (their cluster is a few steps behind) instead of leaving them out
            after a step deadline; training goes on meanwhile (the step is applied when the sync
            ends). Without it a cluster later than a step deadline takes the others' step
            (`step_late`), its Δ in no mean, and the ring closes in fp32 at the end. On the lab
            (4 x char-GPT, 25 Mbit/s, H = 500) clusters drifted apart by more than a step deadline
            within 1,000 steps: one of two syncs missed a cluster in 1 of 3 seeds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    lr: float = Field(default=0.7, gt=0, le=10)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    nesterov: bool = True
    compression: DeltaCompression = DeltaCompression.NONE
    chunk_numel: int = Field(default=1024, ge=8, le=1 << 24)
    topk_fraction: float = Field(default=0.01, gt=0, le=1)
    topk_chunk: int = Field(default=0, ge=0, le=1 << 24)
    topk_bits: int = Field(default=32, ge=2, le=32)
    error_feedback: bool = True
    local_momentum: bool = False
    unsent_stays_local: bool = False
    residual_decay: float = Field(default=1.0, gt=0, le=1)
    num_fragments: int = Field(default=1, ge=1, le=64)
    codec_by_link_mbps: tuple[tuple[float, DeltaCompression], ...] = Field(default=(), max_length=8)
    wait_for_behind: bool = True

    @model_validator(mode="after")
    def _rates_increase(self) -> OuterOptimizerConfig:
        rates = [rate for rate, _ in self.codec_by_link_mbps]
        if any(r <= 0 for r in rates) or rates != sorted(set(rates)):
            raise ValueError("codec_by_link_mbps: rates must be positive and strictly increasing")
        return self

    @property
    def kinds(self) -> frozenset[DeltaCompression]:
        """Every codec a ring of this job may use."""
        return frozenset({self.compression, *(codec for _, codec in self.codec_by_link_mbps)})


class OuterOptimizer:
    """The outer state of one owner's parameters, and its two halves of a sync (pure, no I/O).

    Args:
        config: the outer step and compression.
        plain: names averaged plainly (buffers): no anchor, no momentum, no compression.
    """

    def __init__(self, config: OuterOptimizerConfig, *, plain: Collection[str] = ()) -> None:
        self.config = config
        self.plain = frozenset(plain)
        self.theta: dict[str, Tensor] = {}
        self.momentum: dict[str, Tensor] = {}
        self.residual: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] = {}  # residuals of the sync in progress
        self._pending_momentum: dict[str, Tensor] = {}  # local momentum of the sync in progress
        self.payload_bytes = 0  # encoded size of the last sync's pseudo-gradients
        # names whose anchor may differ from the other replicas' (a sync without every ring member, or
        # imported state): their closing round is a plain average (`OuterAverager`)
        self.diverged: set[str] = set()

    @property
    def wire(self) -> WireCodec | None:
        """The ring's Δ codec when Δ is compressed (the rings then carry encoded Δ, not P)."""
        return self.wire_of(self.config.compression)

    def wire_of(self, kind: DeltaCompression) -> WireCodec | None:
        """The ring codec of `kind` (None: uncompressed, the rings carry P)."""
        return None if kind is DeltaCompression.NONE else WireCodec(kind, self.config.chunk_numel)

    def _codec_args(self) -> dict[str, Any]:
        c = self.config
        return {
            "chunk_numel": c.chunk_numel,
            "topk_fraction": c.topk_fraction,
            "topk_chunk": c.topk_chunk,
            "topk_bits": c.topk_bits,
        }

    def _local_update(self, name: str, delta: Tensor) -> Tensor:
        """With `local_momentum`: this replica's momentum update of Δ (kept until the step)."""
        c = self.config
        if not c.local_momentum or c.momentum == 0:
            return delta
        buf = self.momentum.get(name)
        buf = delta.clone() if buf is None else buf * c.momentum + delta
        self._pending_momentum[name] = buf
        return delta + c.momentum * buf if c.nesterov else buf

    def _outer_update(self, name: str, d_bar: Tensor) -> Tensor:
        """The shared outer momentum's update of the mean Δ̄ (or Δ̄ itself: none, or kept locally)."""
        c = self.config
        if c.local_momentum or c.momentum == 0:
            if name in self._pending_momentum:
                self.momentum[name] = self._pending_momentum.pop(name)
            return d_bar
        buf = self.momentum.get(name)
        buf = d_bar.clone() if buf is None else buf.mul_(c.momentum).add_(d_bar)
        self.momentum[name] = buf
        return d_bar + c.momentum * buf if c.nesterov else buf

    def _continue_from(self, name: str, new: Tensor) -> Tensor:
        """Where this replica continues: the anchor, less what it did not send (`unsent_stays_local`)."""
        c = self.config
        if not (c.unsent_stays_local and c.error_feedback) or name in self.plain or name not in self.residual:
            return new
        return new - self.residual[name]

    def _carried(self, name: str) -> Tensor:
        """The residual added to this sync's Δ (decayed by `residual_decay`)."""
        decay = self.config.residual_decay
        return self.residual[name] if decay == 1 else decay * self.residual[name]

    def initialise(self, named: Mapping[str, Tensor]) -> None:
        """Anchor every name that has none yet at its current value (the start of training).

        With a wire codec, buffers get an anchor too: the ring carries only Δ, so a buffer travels as
        the difference from its last average (shared by all replicas) and is reset to anchor - mean.
        """
        wire = self.config.kinds != {DeltaCompression.NONE}  # some ring may carry Δ
        for name, value in named.items():
            if (wire or name not in self.plain) and value.is_floating_point() and name not in self.theta:
                self.theta[name] = value.detach().to(torch.float32).clone()

    def outgoing(
        self, snapshot: Mapping[str, Tensor], kind: DeltaCompression | None = None
    ) -> dict[str, Tensor]:
        """The proposals P = θ_outer - Δ̂ to average, one per name of `snapshot` (`kind`: as
        `outgoing_deltas`; compressed here only in process, without a ring codec)."""
        c = self.config
        if kind is not None:
            c = c.model_copy(update={"compression": kind})
        out: dict[str, Tensor] = {}
        self.payload_bytes = 0
        for name in snapshot:  # only these names: another fragment's sync may be running
            self._pending.pop(name, None)
            self._pending_momentum.pop(name, None)
        for name, local in snapshot.items():
            if name in self.plain or not local.is_floating_point():
                out[name] = local
                self.payload_bytes += 4 * local.numel()
                continue
            if name not in self.theta:  # no anchor (e.g. not imported after a re-plan): Δ = 0 this time
                logger.warning("outer optimizer: %s had no anchor; anchored at its current value", name)
                self.theta[name] = local.detach().to(torch.float32).clone()
            if c.compression is DeltaCompression.NONE and not c.local_momentum:
                out[name] = local
                self.payload_bytes += 4 * local.numel()
                continue
            delta = self._local_update(name, self.theta[name] - local.detach().to(torch.float32))
            if c.error_feedback and name in self.residual and not c.unsent_stays_local:
                delta = delta + self._carried(name)
            decoded, nbytes = compress(delta, c.compression, **self._codec_args())
            self.payload_bytes += nbytes
            if c.error_feedback:
                self._pending[name] = delta - decoded
            out[name] = (self.theta[name] - decoded).to(local.dtype)
        return out

    def step(self, averaged: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Apply the outer step to every averaged name; return the new values to continue from.

        Names of the last `outgoing` that are not in `averaged` (their ring did not average) keep their
        anchor, momentum and residual.
        """
        c = self.config
        out: dict[str, Tensor] = {}
        for name, mean in averaged.items():
            if name in self.plain or name not in self.theta:
                if name in self.theta:  # a buffer's anchor (for syncs under a Δ codec): the average
                    self.theta[name] = mean.detach().to(torch.float32).clone()
                out[name] = mean
                continue
            p_bar = mean.to(torch.float32)
            d_bar = self.theta[name] - p_bar
            update = self._outer_update(name, d_bar)
            new = p_bar.clone()
            if c.lr != 1 or c.momentum > 0:  # with lr 1, μ 0 the correction is 0: P̄ exactly
                new.add_(d_bar - c.lr * update)
            self.theta[name] = new
            if name in self._pending:
                self.residual[name] = self._pending.pop(name)
            out[name] = self._continue_from(name, new).to(mean.dtype)
        return out

    # ----- Δ on the wire (`deltawire.py`) ------------------------------------------------------
    def outgoing_deltas(
        self, snapshot: Mapping[str, Tensor], kind: DeltaCompression | None = None
    ) -> dict[str, Tensor]:
        """What the rings average with `wire`: c = Δ + residual per name (top-k: its kept entries).

        int8/int4: the ring itself quantises (and reports its roundings for the next residual, see
        `step_deltas`); top-k: chosen here, the ring sums the sparse parts exactly. `kind`: the codec
        of these names' rings (default: the job's `compression`).
        """
        c = self.config
        if kind is not None:
            c = c.model_copy(update={"compression": kind})
        out: dict[str, Tensor] = {}
        self.payload_bytes = 0
        for name in snapshot:  # only these names: another fragment's sync may be running
            self._pending.pop(name, None)
            self._pending_momentum.pop(name, None)
        for name, local in snapshot.items():
            if name not in self.theta:
                logger.warning("outer optimizer: %s had no anchor; anchored at its current value", name)
                self.theta[name] = local.detach().to(torch.float32).clone()
            delta = self.theta[name] - local.detach().to(torch.float32)
            if name not in self.plain:
                delta = self._local_update(name, delta)
            if c.error_feedback and name in self.residual and not c.unsent_stays_local:
                delta = delta + self._carried(name)
            if c.compression is DeltaCompression.TOPK:
                kept, _ = compress(delta, c.compression, **self._codec_args())
                if c.error_feedback:
                    self._pending[name] = delta - kept
                delta = kept
            self.payload_bytes += encoded_bytes(delta.numel(), c.compression, **self._codec_args())
            out[name] = delta
        return out

    def step_deltas(
        self, averaged: Mapping[str, Tensor], lost: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """The outer step from the rings' mean Δ̄; return the new values to continue from.

        `lost`: what this member's ring encodings dropped (int8/int4), the next residual. Buffers take
        anchor - Δ̄ (a plain average). Names not in `averaged` keep anchor, momentum and residual.
        """
        c = self.config
        out: dict[str, Tensor] = {}
        for name, mean in averaged.items():
            d_bar = mean.to(torch.float32)
            if name in self.plain:
                new = self.theta[name] - d_bar
            else:
                new = self.theta[name] - c.lr * self._outer_update(name, d_bar)
            self.theta[name] = new
            if name in self._pending:
                self.residual[name] = self._pending.pop(name)
            elif c.error_feedback and lost is not None and name in lost:
                self.residual[name] = lost[name].to(torch.float32).clone()
            out[name] = self._continue_from(name, new).to(mean.dtype)
        return out

    def step_late(
        self, averaged: Mapping[str, Tensor], sent: Mapping[str, Tensor], kind: DeltaCompression
    ) -> dict[str, Tensor]:
        """The outer step of a member left out of the sync (late) that fetched the others' mean.

        The anchor and momentum take exactly the step the others take (same function, same bits), so
        the replicas' anchors stay identical. This member's own pseudo-gradient c (what it would have
        sent: Δ with its carried residual; `sent` is what `outgoing`/`outgoing_deltas` returned) is in
        no mean: it continues from new anchor - c, so c is in its next Δ (applied at its next sync),
        and its residual is folded into c. Names with no anchor (buffers averaged plainly) take the mean.
        """
        own: dict[str, Tensor] = {}
        for name in averaged:
            if name not in self.theta:
                continue
            if kind is DeltaCompression.NONE:  # the rings carried P = θ_local
                own[name] = self.theta[name] - sent[name].to(torch.float32)
            else:
                own[name] = sent[name].to(torch.float32) + self._pending.get(name, 0)
            self._pending.pop(name, None)
        out = self.step(averaged) if kind is DeltaCompression.NONE else self.step_deltas(averaged)
        for name, c in own.items():
            self.residual.pop(name, None)
            out[name] = (self.theta[name] - c).to(averaged[name].dtype)
        return out

    # ----- the closing round with a Δ codec ------------------------------------------------------
    def closing_deltas(self, snapshot: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The closing round's payload under a Δ codec: Δ + residual per name (no momentum, no top-k).

        The residual is folded in: what compression held back reaches the final weights.
        """
        c = self.config
        out: dict[str, Tensor] = {}
        for name, local in snapshot.items():
            if name not in self.theta:
                self.theta[name] = local.detach().to(torch.float32).clone()
            delta = self.theta[name] - local.detach().to(torch.float32)
            if c.error_feedback and name in self.residual and not c.unsent_stays_local:
                delta = delta + self._carried(name)
            out[name] = delta
        return out

    def close(self, averaged: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The final weights from the closing round's mean Δ̄: anchor - Δ̄ (the same at every replica
        whose anchor is the same); the residual is spent."""
        out: dict[str, Tensor] = {}
        for name, mean in averaged.items():
            new = self.theta[name] - mean.to(torch.float32)
            self.theta[name] = new
            self.residual.pop(name, None)
            out[name] = new.to(mean.dtype)
        return out

    # ----- moving with the stage state -----------------------------------------------------------
    def export_state(self, names: Collection[str] | None = None, *, copy: bool = True) -> dict[str, Tensor]:
        """The outer state as ``outer/<name>/<slot>`` (slots: theta, momentum, residual).

        `copy` False: the live tensors (a sync replaces the anchor and updates the momentum in place).
        """
        out = {}
        for slot, table in zip(_SLOTS, (self.theta, self.momentum, self.residual), strict=True):
            for name, value in table.items():
                if names is None or name in names:  # buffers' anchors too (a Δ codec gives them one)
                    out[f"{OUTER_PREFIX}{name}/{slot}"] = value.clone() if copy else value
        return out

    def import_state(self, tensors: Mapping[str, Tensor], *, shapes: Mapping[str, torch.Size]) -> None:
        """Take exported entries for names this owner holds (`shapes`: name → shape), all or nothing.

        Raises:
            ValueError: an entry is malformed, for a name not in `shapes`, of the wrong shape or dtype,
                not finite, or a momentum/residual comes without its anchor.
        """
        parsed: dict[str, dict[str, Tensor]] = {slot: {} for slot in _SLOTS}
        for key, value in tensors.items():
            name, _, slot = key.removeprefix(OUTER_PREFIX).rpartition("/")
            if not key.startswith(OUTER_PREFIX) or slot not in parsed or name not in shapes:
                raise ValueError(f"{key[:256]!r} is not outer state of this owner")
            if value.dtype != torch.float32 or value.shape != shapes[name]:
                raise ValueError(f"{key}: {value.dtype}{tuple(value.shape)}, expected float32")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{key} has non-finite values")
            parsed[slot][name] = value.detach().clone()
        orphans = (set(parsed["momentum"]) | set(parsed["residual"])) - set(parsed["theta"])
        if orphans:
            raise ValueError(f"momentum or residual without an anchor: {sorted(orphans)[:3]}")
        for name in parsed["theta"]:
            self.momentum.pop(name, None)
            self.residual.pop(name, None)
        self.diverged.update(parsed["theta"])  # maybe not the other replicas' anchor
        self.theta.update(parsed["theta"])
        self.momentum.update(parsed["momentum"])
        self.residual.update(parsed["residual"])
