"""How many micro-batches the first stage keeps in flight: sized from what the pipeline delivers.

Problem. A pipeline over volunteer links needs enough micro-batches in flight to keep its slowest
resource (a stage's compute or a link direction) busy — by Little's law, its rate times a micro-batch's
unloaded round trip (the pipeline's "bandwidth-delay product"). Fewer starve it; more only queue: they
add weight-stash memory and staleness, and on a shaped link they fill its buffer, which delays every
other message that shares it (the reverse direction's gradients, acknowledgements, averaging). No
constant is right everywhere: measured on the lab (benchmarks/results/pipeline_throughput.md), a 3-stage
MLP at 25 Mbit/s peaked at 3 in flight and lost 7 % at 7, while at 100 Mbit/s 3 reached only 0.69 of the
bound and 7 reached 0.92.

Algorithm (the idea of BBR's congestion window, Cardwell et al., ACM Queue 2016, applied to a pipeline):
the first stage timestamps each micro-batch when it is admitted and when its backward comes home.
  * min round trip: the fastest any micro-batch made the round, over the controller's lifetime (one
    plan epoch; a new plan starts a new controller);
  * delivery rate: micro-batches completed per second over the last round's worth of completions
    (``window`` of them), max-filtered over the last ``rate_rounds`` rounds;
  * window = ceil(gain x rate x min round trip), clamped to [floor, cap].
Starting at the floor, a window-limited pipeline completes ``window`` per round trip, so the target is
``gain x window`` and the window grows each round; once the bottleneck is saturated the rate stops
growing, round trips lengthen with queueing instead, and the window settles at gain x the bottleneck's
bandwidth-delay product. ``gain`` > 1 absorbs jitter (the rate and round trip are noisy samples).

Status: opt-in (`PipelineConfig.adaptive_window`), because on the lab it lost. 3-stage MLP,
`bench_pipeline_throughput`, one run: at 25 Mbit/s it settled at 4 in flight, 0.85 of the bound (fixed 3:
0.89, fixed 7: 0.88); at 100 Mbit/s it also settled at 4 and reached 0.58 (fixed 7: 0.89). There round
trips grow with the window long before the bottleneck saturates (CPU-quota throttling and per-message
handling on 0.6-CPU peers, not queueing at one FIFO resource), so rate x min round trip underestimates
what is needed and gain 1.25 cannot grow out of it. Next: probe (grow while the rate grows, as BBR's
startup does) instead of trusting Little's law, and measure over runs longer than 200 micro-batches.
Those runs had the host's TCP BBR in the lab; with Reno (the lab's default since) the fixed 7 reached
0.96 / 0.93 of the bound at 25 / 100 Mbit/s, fixed 3 0.94 / 0.79, adaptive 0.94 / 0.79 (settled at 5).

Limits. The min round trip never expires within an epoch (BBR re-probes it by draining; a pipeline
would lose throughput doing that), so a path that gets permanently slower keeps a window sized for the
faster one — still bounded by ``cap``. Growth is at most ``gain`` per round trip, so a pipeline whose
product is far above the floor takes a few round trips to reach it.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["InflightWindow"]


class InflightWindow:
    """The first stage's in-flight limit, adapted from measured delivery rate and round-trip time."""

    def __init__(self, *, floor: int, cap: int, gain: float = 1.25, rate_rounds: int = 8) -> None:
        if not 1 <= floor <= cap:
            raise ValueError(f"need 1 <= floor <= cap, got floor={floor} cap={cap}")
        if gain < 1.0:
            raise ValueError(f"gain must be >= 1, got {gain}")
        self.floor = floor
        self.cap = cap
        self.gain = gain
        self.size = floor
        self.min_rtt_s = math.inf
        self.max_rate = 0.0  # micro-batches per second
        self._done_at: deque[float] = deque(maxlen=cap + 1)
        # (completion index, rate) samples of the last `rate_rounds` rounds, for the max filter
        self._rates: deque[tuple[int, float]] = deque()
        self._rate_rounds = rate_rounds
        self._completions = 0

    def on_complete(self, admitted_at: float, now: float) -> int:
        """Record a micro-batch that came home; return the new window size."""
        self._completions += 1
        if now >= admitted_at:
            self.min_rtt_s = min(self.min_rtt_s, now - admitted_at)
        self._done_at.append(now)
        span = min(self.size, len(self._done_at) - 1)
        if span >= 1:
            elapsed = now - self._done_at[-1 - span]
            if elapsed > 0:
                self._rates.append((self._completions, span / elapsed))
        horizon = self._completions - self._rate_rounds * self.size
        while self._rates and self._rates[0][0] <= horizon:
            self._rates.popleft()
        self.max_rate = max((rate for _, rate in self._rates), default=0.0)
        if self.max_rate > 0 and math.isfinite(self.min_rtt_s):
            target = math.ceil(self.gain * self.max_rate * self.min_rtt_s - 1e-9)
            self.size = max(self.floor, min(self.cap, target))
        return self.size
