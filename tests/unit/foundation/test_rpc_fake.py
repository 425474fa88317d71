"""The typed RPC layer over the in-memory transport: replies, error replies, limits, deadlines."""

import asyncio

import pytest
import torch
from pydantic import BaseModel, Field

from ravnest_p2p.errors import DeadlineExceeded, InvalidMessage, PeerUnreachable, RemoteError
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint, RpcMethod
from ravnest_p2p.transport.wire import encode_envelope


class AddRequest(BaseModel):
    a: int = Field(ge=0, le=1000)
    b: int = 0


class AddReply(BaseModel):
    total: int


ADD = RpcMethod(
    "add", AddRequest, AddReply, max_request_bytes=64 * 1024, max_tensors=2, handler_timeout_s=0.5
)


@pytest.fixture
async def pair():
    net = FakeNetwork()
    server, client = RpcEndpoint(net.create("srv"), "run"), RpcEndpoint(net.create("cli"), "run")
    calls = []

    async def add(req: AddRequest, tensors, ctx):
        calls.append(ctx.remote_peer_id)
        if req.b == 13:
            raise InvalidMessage("unlucky")
        if req.b == 99:
            raise RuntimeError("boom")
        if req.b == 77:
            await asyncio.sleep(5)
        return AddReply(total=req.a + req.b), [t * 2 for t in tensors]

    await server.serve(ADD, add)
    return net, server, client, calls


async def test_call_returns_typed_reply_and_tensors(pair):
    _, _, client, calls = pair
    reply = await client.call("srv", ADD, AddRequest(a=2, b=3), tensors=[torch.arange(4.0)], timeout_s=1)
    assert reply.message == AddReply(total=5)
    assert torch.equal(reply.tensors[0], torch.arange(4.0) * 2)
    assert calls == ["cli"]


async def test_invalid_request_gets_error_reply_and_handler_is_not_called(pair):
    _, _, client, calls = pair
    with pytest.raises(RemoteError) as err:
        await client.call("srv", ADD, AddRequest.model_construct(a=5000, b=0), timeout_s=1)
    assert err.value.code == "invalid_message"
    assert calls == []
    # the server keeps serving
    assert (await client.call("srv", ADD, AddRequest(a=1), timeout_s=1)).message.total == 1


async def test_handler_errors_become_error_replies(pair):
    _, _, client, _ = pair
    with pytest.raises(RemoteError) as err:
        await client.call("srv", ADD, AddRequest(a=1, b=13), timeout_s=1)
    assert err.value.code == "invalid_message"
    with pytest.raises(RemoteError) as err:
        await client.call("srv", ADD, AddRequest(a=1, b=99), timeout_s=1)
    assert err.value.code == "internal"
    with pytest.raises(RemoteError) as err:
        await client.call("srv", ADD, AddRequest(a=1, b=77), timeout_s=2)
    assert err.value.code == "handler_timeout"


async def test_oversized_and_too_many_tensors_are_refused(pair):
    _, _, client, calls = pair
    with pytest.raises(RemoteError) as err:
        await client.call("srv", ADD, AddRequest(a=1), tensors=[torch.zeros(100_000)], timeout_s=1)
    assert err.value.code == "payload_too_large"
    with pytest.raises(RemoteError) as err:
        await client.call("srv", ADD, AddRequest(a=1), tensors=[torch.zeros(1)] * 3, timeout_s=1)
    assert err.value.code == "invalid_message"
    assert calls == []


async def test_non_finite_tensors_are_refused(pair):
    _, _, client, calls = pair
    with pytest.raises(RemoteError) as err:
        await client.call(
            "srv", ADD, AddRequest(a=1), tensors=[torch.tensor([1.0, float("nan")])], timeout_s=1
        )
    assert err.value.code == "codec_error"
    assert calls == []


async def test_malformed_bytes_get_error_reply():
    net = FakeNetwork()
    server = RpcEndpoint(net.create("srv"), "run")

    async def never(req, tensors, ctx):
        raise AssertionError("must not be called")

    await server.serve(ADD, never)
    raw_client = net.create("raw")
    for payload in [
        b"",
        b"junk",
        encode_envelope({"kind": "request", "body": "not a map"}),
        b"RV1\xff\xff\xff\xff",
    ]:
        reply = await raw_client.call(
            "srv", "ravnest/run/add", payload, stream=False, max_response_bytes=1 << 20
        )
        assert b"invalid_message" in reply or b"payload_too_large" in reply


async def test_deadline_and_unreachable_peers():
    net = FakeNetwork(delay_s=0.3)
    server, client = RpcEndpoint(net.create("srv"), "run"), RpcEndpoint(net.create("cli"), "run")

    async def add(req, tensors, ctx):
        return AddReply(total=0)

    await server.serve(ADD, add)
    with pytest.raises(DeadlineExceeded):
        await client.call("srv", ADD, AddRequest(a=1), timeout_s=0.05)
    with pytest.raises(PeerUnreachable):
        await client.call("ghost", ADD, AddRequest(a=1), timeout_s=1)
    net.kill("srv")
    with pytest.raises(PeerUnreachable):
        await client.call("srv", ADD, AddRequest(a=1), timeout_s=1)


async def test_namespaces_do_not_cross():
    net = FakeNetwork()
    server = RpcEndpoint(net.create("srv"), "run-a")

    async def add(req, tensors, ctx):
        return AddReply(total=1)

    await server.serve(ADD, add)
    other_run = RpcEndpoint(net.create("cli"), "run-b")
    with pytest.raises(PeerUnreachable):
        await other_run.call("srv", ADD, AddRequest(a=1), timeout_s=1)
