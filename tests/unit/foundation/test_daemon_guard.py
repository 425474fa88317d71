"""The guard against hivemind's late-reply race (transport/daemon_guard.py)."""

from __future__ import annotations

import asyncio

from ravnest_p2p.transport.daemon_guard import GuardedCalls, guard_pending_calls


async def test_a_reply_to_a_cancelled_call_is_dropped_and_a_waiting_call_gets_its_reply():
    loop = asyncio.get_running_loop()
    calls = GuardedCalls()
    cancelled, waiting = loop.create_future(), loop.create_future()
    calls["late"], calls["live"] = cancelled, waiting
    cancelled.cancel()  # the caller's deadline: the future is done before the caller pops it
    # what hivemind's reader does on a reply; on a plain dict this raises InvalidStateError
    calls["late"].set_result(b"too late")
    calls["live"].set_result(b"reply")
    assert cancelled.cancelled()
    assert await waiting == b"reply"


async def test_the_guard_wraps_the_daemon_clients_calls_once_and_says_when_it_cannot():
    class Control:
        def __init__(self):
            self._pending_calls = {"x": asyncio.get_running_loop().create_future()}

    class Client:
        control = Control()

    class P2P:
        _client = Client()

    p2p = P2P()
    assert guard_pending_calls(p2p)
    guarded = p2p._client.control._pending_calls
    assert isinstance(guarded, GuardedCalls)
    assert set(guarded) == {"x"}
    assert guard_pending_calls(p2p)
    assert p2p._client.control._pending_calls is guarded
    assert not guard_pending_calls(object())
