"""Pipeline schedules (1F1B and GPipe fill-drain) and a discrete-event simulator of their makespan.

Why: the throughput benchmark compares our asynchronous 1F1B pipeline with a synchronous fill-drain
pipeline and with the slowest-stage bound, on the same per-stage timings, and the simulator gives
the model's prediction next to the measurement.

- **1F1B** (PipeDream, Narayanan et al. SOSP 2019; the non-interleaved form in Megatron-LM,
  Narayanan et al. SC 2021): stage ``s`` of ``S`` runs ``S - s`` forwards to fill the pipeline, then
  alternates one backward and one forward, then drains the remaining backwards. At most ``S - s``
  micro-batches are in flight on stage ``s``, so activation memory is bounded by the depth, not by
  the number of micro-batches.
- **GPipe** (Huang et al. NeurIPS 2019): every stage runs all forwards, then all backwards (last
  micro-batch first); all ``M`` micro-batches are in flight at the peak.

The simulator executes each stage's list in order; an operation starts when its stage is free and
its dependency is done (``F(s, m)`` after ``F(s-1, m)`` plus the link time; ``B(s, m)`` after
``B(s+1, m)`` plus the link time, or after ``F(S-1, m)`` on the last stage). It is exact for these
in-order schedules; it does not model bandwidth sharing or compute jitter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

__all__ = ["Op", "SimulationResult", "gpipe_schedule", "one_f_one_b_schedule", "simulate_schedule"]

Op = tuple[Literal["F", "B"], int]


def _check(num_stages: int, num_micro_batches: int) -> None:
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need >= 1 stage and micro-batch, got {num_stages}, {num_micro_batches}")


def one_f_one_b_schedule(num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """Per-stage operation lists of the 1F1B schedule (see module docstring)."""
    _check(num_stages, num_micro_batches)
    schedule: list[list[Op]] = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage, num_micro_batches)
        ops: list[Op] = [("F", m) for m in range(warmup)]
        next_forward = warmup
        for m in range(num_micro_batches):
            ops.append(("B", m))
            if next_forward < num_micro_batches:
                ops.append(("F", next_forward))
                next_forward += 1
        schedule.append(ops)
    return schedule


def gpipe_schedule(num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """Per-stage operation lists of GPipe's fill-drain schedule."""
    _check(num_stages, num_micro_batches)
    forwards: list[Op] = [("F", m) for m in range(num_micro_batches)]
    backwards: list[Op] = [("B", m) for m in reversed(range(num_micro_batches))]
    return [forwards + backwards for _ in range(num_stages)]


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """Outcome of `simulate_schedule`.

    Attributes:
        makespan_s: time from the first forward to the last backward.
        busy_s: compute time per stage.
        max_in_flight: peak number of micro-batches forwarded but not backwarded, per stage.
        bottleneck_bound_s: ``M * max_s(fwd_s + bwd_s)``, the bound no schedule beats.
    """

    makespan_s: float
    busy_s: tuple[float, ...]
    max_in_flight: tuple[int, ...]
    bottleneck_bound_s: float

    @property
    def utilisation(self) -> tuple[float, ...]:
        """Busy fraction of each stage over the makespan."""
        return tuple(b / self.makespan_s if self.makespan_s > 0 else 0.0 for b in self.busy_s)


def simulate_schedule(
    schedule: Sequence[Sequence[Op]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    *,
    link_s: float | Sequence[float] = 0.0,
) -> SimulationResult:
    """Simulate in-order execution of ``schedule`` with per-stage forward/backward times.

    Args:
        schedule: one op list per stage; every stage must run ``F`` and ``B`` of each micro-batch once.
        forward_s: forward time of one micro-batch on each stage.
        backward_s: backward time of one micro-batch on each stage.
        link_s: transfer time between stage ``s`` and ``s + 1`` (one value or one per link).

    Raises:
        ValueError: inconsistent lengths, negative times, or a schedule that deadlocks.
    """
    num_stages = len(schedule)
    links = [float(link_s)] * max(0, num_stages - 1) if isinstance(link_s, int | float) else list(link_s)
    if num_stages < 1 or len(forward_s) != num_stages or len(backward_s) != num_stages:
        raise ValueError("schedule, forward_s and backward_s must have one entry per stage")
    if len(links) != num_stages - 1:
        raise ValueError(f"need {num_stages - 1} link times, got {len(links)}")
    if min([*forward_s, *backward_s, *links, 0.0]) < 0:
        raise ValueError("times must be non-negative")
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro_batch) -> finish time
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    in_flight = [0] * num_stages
    peak = [0] * num_stages
    remaining = sum(len(ops) for ops in schedule)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while position[s] < len(schedule[s]):
                kind, m = schedule[s][position[s]]
                if kind == "F":
                    dep = done.get(("F", s - 1, m)) if s > 0 else 0.0
                    lag = links[s - 1] if s > 0 else 0.0
                else:
                    last = s == num_stages - 1
                    dep = done.get(("F", s, m)) if last else done.get(("B", s + 1, m))
                    if dep is not None and ("F", s, m) not in done:
                        dep = None
                    lag = 0.0 if last else links[s]
                if dep is None:
                    break
                start = max(free_at[s], dep + lag)
                free_at[s] = start + (forward_s[s] if kind == "F" else backward_s[s])
                done[(kind, s, m)] = free_at[s]
                in_flight[s] += 1 if kind == "F" else -1
                peak[s] = max(peak[s], in_flight[s])
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("schedule deadlocks: an operation waits for one that never runs")
    num_micro_batches = max((m for ops in schedule for _, m in ops), default=-1) + 1
    busy = tuple(
        sum(forward_s[s] if k == "F" else backward_s[s] for k, _ in schedule[s]) for s in range(num_stages)
    )
    bound = num_micro_batches * max(f + b for f, b in zip(forward_s, backward_s, strict=True))
    return SimulationResult(
        makespan_s=max(done.values(), default=0.0),
        busy_s=busy,
        max_in_flight=tuple(peak),
        bottleneck_bound_s=bound,
    )
