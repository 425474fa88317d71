"""Frames are read as their bytes arrive, under deadlines; inbound budgets refuse past their caps."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from ravnest_p2p.errors import PayloadTooLarge
from ravnest_p2p.transport import InboundBudget, WireLimits
from ravnest_p2p.transport.wire import read_frame, read_frame_body

FAST = WireLimits(idle_timeout_s=0.2, frame_floor_s=0.5, min_rate_bytes_per_s=1000.0)


def _reader(*chunks: bytes, eof: bool = False) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    if eof:
        reader.feed_eof()
    return reader


async def test_a_frame_grows_to_its_length_and_is_returned_whole():
    body = bytes(range(256)) * 5000  # 1.28 MB: several growths of the buffer
    reader = asyncio.StreamReader()

    async def feed():
        for start in range(0, len(body), 70_000):
            reader.feed_data(body[start : start + 70_000])
            await asyncio.sleep(0)

    task = asyncio.create_task(feed())
    reader.feed_data(len(body).to_bytes(8, "big"))
    got = await read_frame(reader, max_bytes=len(body))
    await task
    assert bytes(got) == body


async def test_an_announced_length_costs_nothing_before_its_bytes():
    reader = _reader((256 << 20).to_bytes(8, "big") + b"12345678")
    tracemalloc.start()
    try:
        with pytest.raises(TimeoutError, match="idle"):
            await read_frame(reader, max_bytes=1 << 30, limits=FAST)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


async def test_oversized_announcement_is_refused_before_the_body():
    reader = _reader((5000).to_bytes(8, "big"))
    with pytest.raises(PayloadTooLarge):
        await read_frame(reader, max_bytes=4999)


async def test_a_trickle_faster_than_idle_but_slower_than_the_rate_hits_the_frame_deadline():
    reader = asyncio.StreamReader()

    async def trickle():
        while True:
            reader.feed_data(b"x" * 10)
            await asyncio.sleep(0.05)

    # 0.3 s + 0.1 s allowed, 10 bytes every 50 ms arrive: never idle for 1 s
    limits = WireLimits(idle_timeout_s=1.0, frame_floor_s=0.3, min_rate_bytes_per_s=1e6)
    task = asyncio.create_task(trickle())
    try:
        with pytest.raises(TimeoutError, match="frame deadline"):
            await read_frame_body(reader, 100_000, limits=limits)
    finally:
        task.cancel()


async def test_a_stream_that_ends_early_is_an_incomplete_read():
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(_reader((10).to_bytes(8, "big") + b"abc", eof=True), max_bytes=100)


def test_budget_slots_and_bytes_per_peer_and_in_total():
    budget = InboundBudget(
        WireLimits(
            max_inbound_per_peer=2,
            max_inbound_total=3,
            max_bytes_per_peer=1000,
            max_bytes_total=1500,
            small_request_bytes=10,
        )
    )
    a1, a2 = budget.admit("a"), budget.admit("a")
    assert a1 is not None
    assert a2 is not None
    assert budget.admit("a") is None  # a's slots
    b1 = budget.admit("b")
    assert b1 is not None
    assert budget.admit("c") is None  # all slots
    assert a1.reserve(900)
    assert not a2.reserve(200)  # a's bytes
    assert a2.reserve(5)  # small: no bytes
    assert not b1.reserve(700)  # the total
    assert b1.reserve(600)
    assert budget.held() == (3, 1500)
    a1.release()
    a1.release()  # idempotent
    assert budget.held("a") == (1, 0)
    assert budget.held() == (2, 600)
    for lease in (a2, b1):
        lease.release()
    assert budget.held() == (0, 0)
