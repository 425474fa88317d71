"""The adaptive in-flight window against a simulated pipeline of FIFO resources (stages and links)."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest

from ravnest_p2p.runtime.window import InflightWindow


def simulate(
    service_s: list[float],
    window: InflightWindow,
    *,
    micro_batches: int = 400,
    jitter: float = 0.0,
    seed: int = 0,
) -> tuple[float, list[int]]:
    """Micro-batches visit every resource in order (one at a time per resource, FIFO); the window admits.

    Returns delivered micro-batches per second over the second half of the run, and the window sizes.
    """
    rng = random.Random(seed)
    free_at = [0.0] * len(service_s)
    outstanding: deque[tuple[float, float]] = deque()  # (admitted at, completes at), in order
    admitted, now, done_times, sizes = 0, 0.0, [], []
    while admitted < micro_batches or outstanding:
        while admitted < micro_batches and len(outstanding) < window.size:
            t = now
            for j, s in enumerate(service_s):
                t = max(t, free_at[j]) + s * (1 + jitter * (2 * rng.random() - 1))
                free_at[j] = t
            outstanding.append((now, t))
            admitted += 1
        admitted_at, now = outstanding.popleft()
        sizes.append(window.on_complete(admitted_at, now))
        done_times.append(now)
    half = len(done_times) // 2
    return (len(done_times) - 1 - half) / (done_times[-1] - done_times[half]), sizes


# a 3-stage pipeline: fwd computes, link directions, bwd computes (the round trip of one micro-batch)
LINK_BOUND = [0.011, 0.066, 0.013, 0.131, 0.008, 0.066, 0.013, 0.131, 0.011]  # a slow link dominates
COMPUTE_BOUND = [0.030, 0.004, 0.035, 0.004, 0.030, 0.004, 0.035, 0.004, 0.030]
LONG_PATH = [0.012, 0.016, 0.023, 0.033, 0.010, 0.016, 0.023, 0.033, 0.012]  # product ~5.5 micro-batches


@pytest.mark.parametrize("path", [LINK_BOUND, COMPUTE_BOUND, LONG_PATH])
def test_reaches_the_bottleneck_rate_without_queueing_far_beyond_it(path: list[float]) -> None:
    window = InflightWindow(floor=3, cap=7)
    rate, sizes = simulate(path, window, jitter=0.1)
    bottleneck_rate = 1 / max(path)
    product = sum(path) * bottleneck_rate  # micro-batches a saturated pipeline holds
    assert rate >= 0.95 * bottleneck_rate
    settled = sizes[len(sizes) // 2 :]
    assert max(settled) <= max(3, math.ceil(window.gain * product * 1.15))


def test_grows_from_the_floor_when_the_window_limits_the_rate() -> None:
    window = InflightWindow(floor=3, cap=7)
    _, sizes = simulate(LONG_PATH, window)
    assert sizes[0] == 3
    assert max(sizes) >= 6  # the product (5.5) needs more than the floor
    fixed_rate, _ = simulate(LONG_PATH, InflightWindow(floor=3, cap=3))
    adaptive_rate, _ = simulate(LONG_PATH, InflightWindow(floor=3, cap=7))
    assert adaptive_rate > 1.3 * fixed_rate


def test_stays_within_floor_and_cap() -> None:
    window = InflightWindow(floor=2, cap=4, gain=3.0)
    _, sizes = simulate(LONG_PATH, window, jitter=0.5)
    assert min(sizes) >= 2
    assert max(sizes) <= 4
    window = InflightWindow(floor=3, cap=9)
    _, sizes = simulate([0.1], window)  # one resource: nothing to overlap, the floor is enough
    assert set(sizes) == {3}


def test_ignores_clock_going_backwards_and_rejects_bad_bounds() -> None:
    window = InflightWindow(floor=1, cap=5)
    assert window.on_complete(admitted_at=10.0, now=9.0) == 1
    assert window.min_rtt_s == math.inf
    with pytest.raises(ValueError):
        InflightWindow(floor=0, cap=3)
    with pytest.raises(ValueError):
        InflightWindow(floor=4, cap=3)
    with pytest.raises(ValueError):
        InflightWindow(floor=1, cap=3, gain=0.5)
