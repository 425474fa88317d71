"""The view's memory buckets are fine enough for the planner's fit decisions, and stable."""

import math

from ravnest_p2p.measurement.memory import steady_memory_bytes
from ravnest_p2p.membership import Capacity
from ravnest_p2p.membership.view import MEMORY_STEPS_PER_OCTAVE

FIGURES = {"flops": 1e11, "upload_mbps": 100.0, "download_mbps": 100.0}


def planned_memory(memory_bytes: float) -> int:
    return Capacity.from_figures(memory_bytes=memory_bytes, **FIGURES).to_peer_capacity("p").memory_bytes


def test_a_bucket_edge_is_never_above_the_figure_and_at_most_a_sixteenth_octave_under():
    worst = 0.0
    for i in range(4000):
        figure = 2**20 * 1.0017**i * 37  # 37 MiB .. ~30 GiB, off the edges
        planned = planned_memory(figure)
        assert planned <= figure
        worst = max(worst, 1 - planned / figure)
    assert worst <= 1 - 2 ** (-1 / MEMORY_STEPS_PER_OCTAVE) + 1e-9  # 4.2 %
    for octave in (20, 30, 33):  # exact powers of two sit on an edge
        assert planned_memory(2.0**octave) == 2**octave


def test_the_bench_peer_that_lost_a_quarter_of_its_memory_keeps_it():
    # at a 1.63 GB cap one peer had 1.047e9 bytes free: half-octave buckets planned it with 0.76e9
    assert planned_memory(1.047e9) >= 0.96 * 1.047e9


def test_memory_buckets_are_deterministic_and_distinguish_a_few_percent():
    a = Capacity.from_figures(memory_bytes=1.20e9, **FIGURES)
    assert a == Capacity.from_figures(memory_bytes=1.20e9, **FIGURES)
    assert a.digest() == Capacity.from_figures(memory_bytes=1.20e9, **FIGURES).digest()
    assert a != Capacity.from_figures(memory_bytes=1.30e9, **FIGURES)  # 8 % more: another bucket
    assert isinstance(a.memory_bucket, int)
    assert a.memory_bucket == math.floor(16 * math.log2(1.20e9))


def test_published_free_memory_moves_only_past_its_hysteresis_band():
    published = steady_memory_bytes(None, 4_000_000_000)
    assert published == 4_000_000_000
    for jitter in (3_900_000_000, 4_150_000_000, 3_700_000_000):  # within 9 %: unchanged
        assert steady_memory_bytes(published, jitter) == published
    assert steady_memory_bytes(published, 3_500_000_000) == 3_500_000_000  # a real drop is published
    assert steady_memory_bytes(published, 4_500_000_000) == 4_500_000_000
