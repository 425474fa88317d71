"""`RunClient.connect` is awaitable and an async context manager that closes the client on any exit."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest

from ravnest_p2p import RunClient


class FakeClient:
    def __init__(self) -> None:
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    client = FakeClient()

    async def connect(*args: Any, **kwargs: Any) -> FakeClient:
        return client

    monkeypatch.setattr(RunClient, "_connect", connect)
    return client


async def _fail_inside(fake: FakeClient) -> None:
    async with RunClient.connect(["/ip4/127.0.0.1/tcp/1/p2p/QmX"], "r") as client:
        assert client is fake
        raise RuntimeError("boom")


async def test_async_with_closes_the_client_on_error(fake: FakeClient) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        await _fail_inside(fake)
    assert fake.closed == 1


async def test_await_gives_the_client_and_leaves_closing_to_the_caller(fake: FakeClient) -> None:
    client = await RunClient.connect(["/ip4/127.0.0.1/tcp/1/p2p/QmX"], "r")
    assert client is fake
    assert fake.closed == 0


async def test_a_connection_is_used_once(fake: FakeClient) -> None:
    connecting = RunClient.connect(["/ip4/127.0.0.1/tcp/1/p2p/QmX"], "r")
    await connecting
    with pytest.raises(RuntimeError, match="once"):
        await connecting


def test_a_connection_never_awaited_leaves_no_warning(fake: FakeClient) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunClient.connect(["/ip4/127.0.0.1/tcp/1/p2p/QmX"], "r")  # dropped at once
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
