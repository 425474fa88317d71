"""Chunk sizes by link rate: optimal (checked against the LP's dual), exact, and safe fallbacks."""

import itertools
import random
from fractions import Fraction

import pytest

from ravnest_p2p.averaging.weights import (
    chunk_bounds,
    chunk_fractions,
    equal_bounds,
    link_loads,
    optimal_ring_time,
)


def busiest_link_time(chunks, link_rates):
    return max(load / r for load, r in zip(link_loads(chunks), link_rates, strict=True))


def dual_bound(link_rates):
    """max over sets I of links, no two consecutive on the ring, of (2|I| - 1) / sum(r[I]); odd C also
    2(C-1) / sum(r) (the all-1/2 vertex): the LP's dual, by enumeration."""
    c = len(link_rates)
    best = Fraction(0)
    for mask in range(1, 1 << c):
        picked = [i for i in range(c) if mask >> i & 1]
        if any((i + 1) % c in picked for i in picked):
            continue
        best = max(best, Fraction(2 * len(picked) - 1, sum(link_rates[i] for i in picked)))
    if c % 2:
        best = max(best, Fraction(2 * (c - 1), sum(link_rates)))
    return best


@pytest.mark.parametrize("num_members", [3, 4, 5, 8])
def test_equal_rates_give_equal_chunks(num_members):
    assert chunk_fractions([100.0] * num_members, [100.0] * num_members) is None
    assert chunk_bounds(1000, [7.5] * num_members) == equal_bounds(1000, num_members)


def test_the_slow_member_moves_the_shard_once_instead_of_one_and_a_half_times():
    rates = [25.0, 50.0, 100.0, 200.0]  # ring order; link i = min(rate[i], rate[i+1])
    links = [Fraction(min(rates[i], rates[(i + 1) % 4])) for i in range(4)]
    chunks = chunk_fractions(rates, rates)
    assert chunks is not None
    assert sum(chunks) == 1
    loads = link_loads(chunks)
    assert loads[0] == loads[3] == 1  # the 25 Mbit/s member's upload (link 0) and download (link 3)
    equal = link_loads([Fraction(1, 4)] * 4)
    assert equal[0] == equal[3] == Fraction(3, 2)
    assert busiest_link_time(chunks, links) == Fraction(1, 25)  # = S / B_min, vs 1.5 S / B_min
    assert busiest_link_time(chunks, links) == Fraction(2, 3) * busiest_link_time([Fraction(1, 4)] * 4, links)


def test_the_optimum_matches_the_dual_and_the_chunks_reach_it():
    rng = random.Random(5)
    for _ in range(15):
        c = rng.randint(3, 6)
        links = [rng.randint(1, 20) for _ in range(c)]
        time = optimal_ring_time(links)
        assert time == dual_bound(links)
        # the chunks picked reach it (up to the rates' rounding to parts per million of the fastest)
        rates = [float(r) for r in links]
        chunks = chunk_fractions(rates, [rates[(i - 1) % c] for i in range(c)])  # download[i+1] = link i
        if chunks is not None:
            assert busiest_link_time(chunks, links) <= time * (1 + Fraction(1, 10**5))
            assert all(x >= 0 for x in chunks)
            assert sum(chunks) == 1


def test_asymmetric_links_use_the_slower_end_of_each_link():
    # member 0 uploads fast but downloads slowly: link 3 (into member 0) is the slow one
    upload = [400.0, 100.0, 100.0, 100.0]
    download = [25.0, 100.0, 100.0, 100.0]
    chunks = chunk_fractions(upload, download)
    assert chunks is not None
    loads = link_loads(chunks)
    assert loads[3] == 1
    assert chunks == chunk_fractions([100.0, 100.0, 100.0, 25.0], [25.0, 100.0, 100.0, 100.0])


@pytest.mark.parametrize(
    "rates",
    [
        [25.0, 0.0, 100.0, 200.0],
        [25.0, -1.0, 100.0, 200.0],
        [25.0, float("nan"), 100.0, 200.0],
        [25.0, float("inf"), 100.0, 200.0],
        [25.0, 50.0],  # C = 2: every member sends exactly S whatever the split
        [25.0],
    ],
)
def test_unknown_or_degenerate_rates_fall_back_to_equal_chunks(rates):
    assert chunk_bounds(999, rates) == equal_bounds(999, len(rates))


def test_mismatched_upload_and_download_lengths_fall_back():
    assert chunk_fractions([25.0, 50.0, 100.0], [25.0, 50.0]) is None


def test_small_gains_keep_equal_chunks():
    assert chunk_fractions([100.0, 100.0, 100.0, 99.0], [100.0, 100.0, 100.0, 99.0]) is None


def test_bounds_cover_the_shard_and_do_not_depend_on_the_unit():
    rates = [25.0, 50.0, 100.0, 200.0]
    for numel in (0, 1, 7, 1000, 16_000_003):
        bounds = chunk_bounds(numel, rates)
        assert bounds[0] == 0
        assert bounds[-1] == numel
        assert all(a <= b for a, b in itertools.pairwise(bounds))
        assert bounds == chunk_bounds(numel, [r * 125_000 for r in rates])  # Mbit/s or bytes/s
    uneven = chunk_bounds(1000, [100.0, 90.0, 80.0, 70.0])
    assert uneven != equal_bounds(1000, 4)
    assert max(abs(a - b) for a, b in zip(uneven, [0, 350, 600, 750, 1000], strict=True)) <= 1
