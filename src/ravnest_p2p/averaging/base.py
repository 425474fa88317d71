"""Configuration and per-round metrics of the ring all-reduce, and the flat-shard packing helpers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field

from ravnest_p2p.averaging.shards import Shard
from ravnest_p2p.transport import Compression
from ravnest_p2p.utils.aio import run_in_compute_thread

__all__ = ["RingConfig", "RingMetrics", "RoundMetrics", "flatten_shard", "split_shard"]

_INLINE_NUMEL = 1 << 20  # flatten/split larger shards on the compute thread


class RingConfig(BaseModel):
    """How rings move data and how long they wait."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    part_size_bytes: int = Field(default=256 << 10, ge=1024, le=32 << 20)
    compression: Compression = Compression.NONE
    step_timeout_s: float = Field(default=10.0, gt=0)
    round_timeout_s: float = Field(default=120.0, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    max_attempts: int = Field(default=3, ge=1, le=100)
    max_buffered_messages: int = Field(default=256, ge=0)  # early streams waiting for their round
    # size chunks by the members' link rates when the round is given them (`weights.py`)
    weighted_chunks: bool = True
    # part streams to the right neighbour per attempt, parts dealt round-robin. Each libp2p stream has
    # its own flow-control window in the daemons, and one stream's window, not the link, capped a ring
    # member at ~0.92 of a 100 Mbit/s link's wire rate (lab, 64 MB, 4 peers: 8.69 s/round with 1
    # stream, 8.20-8.22 s with 2, 3 or 4; see `partstream.py`). One while the pipeline sends (`ring_io.py`)
    streams_per_neighbour: int = Field(default=2, ge=1, le=8)
    # with link rates in payload bytes/s: send at most this fraction of min(my upload, right's download),
    # so that my uplink's queue stays short. Lab, 64 MB, 25/50/100/200 Mbit/s, chunks by rate: 26.1 s
    # unpaced, 23.7 s paced at 0.92; but uniform 100 Mbit/s: 8.3 s unpaced, 8.85 s paced (the cap
    # costs more than the queue). Off by default; needs trustworthy rates. None = as fast as it goes
    pace_fraction: float | None = Field(default=None, gt=0, le=1)


@dataclass
class RingMetrics:
    ring_id: str
    numel: int
    participants: tuple[str, ...]
    attempts: int
    time_s: float
    bytes_sent: int
    bytes_received: int


@dataclass
class RoundMetrics:
    """What one round cost at this peer (bytes are tensor payloads, without headers)."""

    round: int
    time_s: float
    bytes_sent: int
    bytes_received: int
    rings: list[RingMetrics] = field(default_factory=list)

    @property
    def participants(self) -> dict[str, tuple[str, ...]]:
        """Ring id → the members whose values are in that ring's average."""
        return {r.ring_id: r.participants for r in self.rings}


def _flatten(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return torch.zeros(0)
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in parts])


def _split(flat: torch.Tensor, shard: Shard, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, numel in zip(shard.names, shard.numels, strict=True):
        ref = like[name]
        # views of `flat`, a buffer made for this round that nobody else holds: no copy needed
        out[name] = flat[offset : offset + numel].reshape(ref.shape).to(ref.dtype)
        offset += numel
    return out


async def flatten_shard(parts: list[torch.Tensor], numel: int) -> torch.Tensor:
    if numel <= _INLINE_NUMEL:
        return _flatten(parts)
    return await run_in_compute_thread(_flatten, parts)


async def split_shard(
    flat: torch.Tensor, shard: Shard, like: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    if shard.numel <= _INLINE_NUMEL:
        return _split(flat, shard, like)
    return await run_in_compute_thread(_split, flat, shard, like)
