"""The traffic gate: background waits for foreground, boundedly; no starvation; cancelling leaves no trace."""

import asyncio
import time

import pytest
import torch
from pydantic import BaseModel

from ravnest_p2p.transport import FakeNetwork, RpcEndpoint, RpcMethod
from ravnest_p2p.transport.priority import GateConfig, TrafficGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_background_goes_at_once_when_foreground_is_idle():
    gate = TrafficGate(GateConfig(max_yield_s=10))
    async with asyncio.timeout(0.5):
        await gate.background_turn(busy_s=5)
    assert gate.stats.background_turns == 1
    assert gate.stats.yielded_turns == gate.stats.forced_turns == 0


async def test_background_waits_until_every_foreground_send_ends():
    gate = TrafficGate(GateConfig(max_yield_s=10))  # busy_s=5 below: a budget of 10 s
    first, second = gate.foreground(), gate.foreground()
    first.__enter__()
    second.__enter__()
    turn = asyncio.create_task(gate.background_turn(busy_s=5))
    await asyncio.sleep(0.02)
    assert not turn.done()
    first.__exit__(None, None, None)
    await asyncio.sleep(0.02)
    assert not turn.done()  # the other send is still in progress
    second.__exit__(None, None, None)
    async with asyncio.timeout(0.5):
        await turn
    assert gate.stats.yielded_turns == 1
    assert gate.stats.forced_turns == 0


async def test_background_keeps_its_share_under_a_foreground_that_never_pauses():
    gate = TrafficGate(GateConfig(min_share=0.25, max_yield_s=10))
    part_s = 0.01  # each background part keeps the link busy this long
    with gate.foreground():
        started = time.monotonic()
        for _ in range(5):
            await gate.background_turn(busy_s=part_s)
            await asyncio.sleep(part_s)
        elapsed = time.monotonic() - started
    assert gate.stats.forced_turns == 5
    # background's time share is min_share: a part of 10 ms per 40 ms (0.2 s in all on a quiet host),
    # never less, and no turn waits out max_yield_s (starvation: 50 s). No tighter upper bound: a
    # busy host stretches the sleeps (0.72 s at load 11 on 2 cores)
    assert elapsed >= 5 * part_s / 0.25 * 0.9
    assert elapsed < 10


def test_yield_budget_follows_the_share_and_its_cap():
    gate = TrafficGate(GateConfig(min_share=0.2, max_yield_s=1.0))
    assert gate.yield_budget_s(0.1) == pytest.approx(0.4)
    assert gate.yield_budget_s(0.0) == 0.0  # a first part goes at once
    assert gate.yield_budget_s(5.0) == 1.0  # capped: waits stay short against step deadlines
    assert TrafficGate(GateConfig(min_share=1.0)).yield_budget_s(3.0) == 0.0  # no priority at all


async def test_a_turn_never_waits_longer_than_max_yield():
    gate = TrafficGate(GateConfig(min_share=0.01, max_yield_s=0.02))
    with gate.foreground():
        started = time.monotonic()
        await gate.background_turn(busy_s=100)
        assert time.monotonic() - started < 0.3
    assert gate.stats.forced_turns == 1


async def test_a_cancelled_wait_leaves_nothing_behind():
    gate = TrafficGate(GateConfig(max_yield_s=10))
    with gate.foreground():
        turn = asyncio.create_task(gate.background_turn(busy_s=5))
        await asyncio.sleep(0.01)
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        assert not gate._idle_waiters
    assert not gate.foreground_active
    async with asyncio.timeout(0.5):
        await gate.background_turn(busy_s=5)


async def test_a_failed_foreground_send_still_ends():
    gate = TrafficGate()

    def failing_send() -> None:
        with gate.foreground():
            assert gate.foreground_active
            raise RuntimeError("send failed")

    with pytest.raises(RuntimeError):
        failing_send()
    assert not gate.foreground_active


def test_window_applies_only_while_foreground_is_recent():
    clock = Clock()
    gate = TrafficGate(GateConfig(recent_s=1.0, window_bytes=256 << 10), clock=clock)
    assert gate.background_window_parts(64 << 10) is None  # never any foreground: no limit
    with gate.foreground():
        assert gate.background_window_parts(64 << 10) == 4
        assert gate.background_window_parts(1 << 20) == 1  # at least one part
    clock.now += 0.5
    assert gate.background_window_parts(64 << 10) == 4
    clock.now += 0.6
    assert gate.background_window_parts(64 << 10) is None


class Ping(BaseModel):
    n: int = 0


PING = RpcMethod("ping", Ping, Ping)


async def test_rpc_calls_with_tensors_are_foreground_by_default():
    net = FakeNetwork()
    server, client = RpcEndpoint(net.create("srv"), "run"), RpcEndpoint(net.create("cli"), "run")
    seen: list[bool] = []

    async def ping(req, tensors, ctx):
        seen.append(client.transport.gate.foreground_active)
        return Ping(n=req.n)

    await server.serve(PING, ping)
    await client.call("srv", PING, Ping(), tensors=[torch.zeros(4)], timeout_s=1)
    await client.call("srv", PING, Ping(), timeout_s=1)
    await client.call("srv", PING, Ping(), foreground=True, timeout_s=1)
    await client.call("srv", PING, Ping(), tensors=[torch.zeros(4)], foreground=False, timeout_s=1)
    assert seen == [True, False, True, False]
    assert not client.transport.gate.foreground_active
    assert client.transport.gate.stats.foreground_sends == 2
