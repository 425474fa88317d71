"""Configuration, counters and work items of a network pipeline stage (see `runtime.service`)."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from ravnest_p2p.planning.window import default_window  # the one definition (planner and runtime)
from ravnest_p2p.transport.codec import Compression

__all__ = ["PipelineConfig", "StageStats", "Work", "default_window", "tensor_bytes"]


class PipelineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_in_flight: int | None = Field(default=None, ge=1, description="window; None: `default_window`")
    adaptive_window: bool = Field(
        default=False, description="first stage adapts its window between S and max_in_flight (experimental)"
    )
    compression: Compression = Compression.NONE
    send_timeout_s: float = Field(default=60.0, gt=0)
    send_attempts: int = Field(default=3, ge=1)
    micro_batch_timeout_s: float = Field(default=300.0, gt=0)
    max_abs_value: float | None = Field(
        default=1e10,
        gt=0,
        description="float activations/gradients beyond +-this are refused; None: finite only",
    )
    heartbeat_period_s: float = Field(default=1.0, gt=0, description="ping each neighbour this often")
    neighbour_timeout_s: float = Field(
        default=6.0, gt=0, description="a neighbour silent this long (pings unanswered) is lost"
    )
    misbehaviour_threshold: int = Field(
        default=20, ge=1, description="refused messages of one sender in an epoch that exclude it"
    )
    epoch_transition_s: float = Field(
        default=60.0,
        gt=0,
        description="after an in-place move to a new plan epoch, the previous one stays accepted this long",
    )
    reissue_attempts: int = Field(
        default=1,
        ge=0,
        description="first stage: times a dropped micro-batch is re-issued before skipping it",
    )


@dataclasses.dataclass
class StageStats:
    forwards: int = 0
    backwards: int = 0
    samples: int = 0
    completed: int = 0  # first stage: micro-batches whose backward came home
    last_loss: float | None = None
    refused: int = 0  # messages this stage refused (counted against their senders)
    dropped: int = 0  # micro-batches dropped here (refused downstream, poisoned, or notified)
    reissued: int = 0  # first stage: dropped micro-batches admitted again under a new id
    skipped: int = 0  # first stage: dropped micro-batches given up on
    bytes_sent: int = 0
    compute_s: float = 0.0  # time this stage's work ran on the compute thread (fwd, bwd + step, eval)
    train_wall_s: float = 0.0  # first stage: wall time inside `train` calls
    send_busy_s: float = 0.0  # wall time with at least one send (call until its reply) in progress
    sends_in_progress: int = 0
    _busy_since: float = 0.0
    started_monotonic: float = dataclasses.field(default_factory=time.monotonic)
    recent: deque[tuple[float, int]] = dataclasses.field(default_factory=lambda: deque(maxlen=64))

    def send_started(self) -> None:
        if self.sends_in_progress == 0:
            self._busy_since = time.perf_counter()
        self.sends_in_progress += 1

    def send_ended(self) -> None:
        self.sends_in_progress -= 1
        if self.sends_in_progress == 0:
            self.send_busy_s += time.perf_counter() - self._busy_since

    def samples_per_s(self) -> float:
        if len(self.recent) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.recent[0], self.recent[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)


@dataclasses.dataclass
class Work:
    kind: str  # "forward" | "backward" | "eval" | "drop"
    micro_batch_id: int
    tensor: Tensor | None
    labels: Tensor | None = None
    loss: float | None = None
    reason: str = ""  # "drop": why


def tensor_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
