"""A generic envelope fuzzer against every RPC method real peers serve.

The targets: a `Peer` (ping, probe, gossip), the three stages of a pipeline (forward, backward,
eval_result, finish, stage_ready) and a ring (ring_status), all on real p2p daemons. Methods are
enumerated from the endpoints (`RpcEndpoint.served`), so a method added later is fuzzed too. A stranger
sends each of them random bytes, truncated and oversized envelopes, wrong kinds and types, absurd header
and blob sizes, garbage and non-finite tensors, over both the unary and the stream path. Every message
must get an error reply (or, for a harmless valid request, a response), no handler may fail
(``internal``), and nothing may change: parameters, in-flight work, weight versions, ring sessions.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any

import msgpack
import pytest
import torch

from ravnest_p2p.averaging import RingAllReduce
from ravnest_p2p.errors import TransportError
from ravnest_p2p.runtime.messages import READY, ReadyRequest
from ravnest_p2p.training.local import local_pipeline
from ravnest_p2p.transport import P2PTransport, RpcEndpoint, RpcMethod, encode_tensor
from ravnest_p2p.transport.wire import decode_envelope, encode_envelope
from tests.integration.foundation.conftest import close_all, start_swarm
from tests.security._wire_support import FRAME_LEN, hosts, open_raw, until_closed
from tests.security.test_wire_streams import JOB, NS

pytestmark = pytest.mark.timeout(300)

EXPECTED_METHODS = {
    "ping",
    "probe_bandwidth",
    "gossip_view",
    "forward",
    "backward",
    "eval_result",
    "finish",
    "stage_ready",
    "ring_status",
}
_ODD_VALUES: list[Any] = [
    None,
    -1,
    2**64 - 1,
    -(2**63),
    "x" * 300,
    1.5,
    [],
    {},
    True,
    "",
    [1, [2, [3]]],
    {"a": 1},
]


def _body(method: RpcMethod[Any, Any], rng: random.Random) -> dict[str, Any]:
    """The request model's fields, at least one of them with a value of the wrong type or range."""
    names = list(method.request_type.model_fields) or ["x"]
    body = {name: rng.choice([*_ODD_VALUES, 0, 1, 7]) for name in names}
    body[rng.choice(names)] = rng.choice(_ODD_VALUES)
    if rng.random() < 0.2:
        body[rng.choice(["epoch", "kind", "blobs", "\x00", "🙂"])] = rng.choice(_ODD_VALUES)
    return body


def _tensor_blob(rng: random.Random) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randrange(0, 400))  # not a tensor
    if choice == 1:
        return encode_tensor(torch.full((rng.randrange(1, 64),), float("nan")))
    if choice == 2:
        return encode_tensor(torch.zeros(3, 1000, dtype=torch.float64))
    return encode_tensor(torch.zeros(rng.randrange(0, 8), dtype=torch.int64))


def hostile_message(method: RpcMethod[Any, Any], rng: random.Random) -> tuple[str, bytes]:
    """(kind of attack, bytes) for `method`."""
    kind = rng.choice(
        [
            "random",
            "bad_magic",
            "header_len",
            "truncated",
            "wrong_kind",
            "body_types",
            "body_not_map",
            "blob_sizes",
            "tensors",
            "deep",
            "oversized",
        ]
    )
    valid_shape = {"kind": "request", "body": _body(method, rng)}
    if kind == "random":
        return kind, rng.randbytes(rng.randrange(0, 2000))
    if kind == "bad_magic":
        return kind, b"RV2" + encode_envelope(valid_shape)[3:]
    if kind == "header_len":
        return kind, b"RV1" + struct.pack("!I", rng.choice([2**32 - 1, 2**20, 300_000])) + rng.randbytes(50)
    if kind == "truncated":
        data = encode_envelope(valid_shape, [_tensor_blob(rng)])
        return kind, data[: rng.randrange(0, len(data))]
    if kind == "wrong_kind":
        return kind, encode_envelope(
            {**valid_shape, "kind": rng.choice(["response", "error", 7, None, "x" * 99])}
        )
    if kind == "body_types":
        return kind, encode_envelope(valid_shape)
    if kind == "body_not_map":
        return kind, encode_envelope({"kind": "request", "body": rng.choice([[], 1, "x", None, b"\x00" * 9])})
    if kind == "blob_sizes":
        packed = msgpack.packb(
            {
                "kind": "request",
                "body": valid_shape["body"],
                "blobs": rng.choice([[2**64 - 1], [-1], ["x"], [10**12], [0] * 5000, [1, 2, 3], {"a": 1}]),
            },
            use_bin_type=True,
        )
        return kind, b"RV1" + struct.pack("!I", len(packed)) + packed + rng.randbytes(rng.randrange(0, 64))
    if kind == "tensors":
        blobs = [_tensor_blob(rng) for _ in range(rng.randrange(1, 4))]
        return kind, encode_envelope(valid_shape, blobs)
    if kind == "deep":
        depth = rng.choice([600, 5000])
        packed = b"\x91" * depth + b"\xc0"
        return kind, b"RV1" + struct.pack("!I", len(packed)) + packed
    # oversized: past the method's cap when that is cheap to send (the stream path announces it below)
    size = min(method.max_request_bytes + 1 + rng.randrange(0, 4096), 3 << 20)
    return kind, b"RV1" + rng.randbytes(size - 3)


def _verdict(reply: bytes) -> str:
    try:
        envelope = decode_envelope(reply, max_bytes=64 << 20)
    except Exception:
        return "garbled"
    kind = envelope.header.get("kind")
    if kind == "error":
        return "internal" if envelope.header.get("code") == "internal" else "refused"
    return "response" if kind == "response" else "garbled"


def _state(services, ring: RingAllReduce) -> str:
    h = hashlib.sha256()
    for service in services:
        for name, value in sorted(service.executor.parameters_by_name().items()):
            h.update(name.encode())
            h.update(value.detach().numpy().tobytes())
        h.update(repr((service.executor.in_flight, service.executor.weight_version)).encode())
        h.update(repr((service.finished.is_set(), service.stats.completed)).encode())
    h.update(repr(sorted(ring._sessions)).encode())
    return h.hexdigest()


async def _fuzz(hostile, per_method: int, seed: int) -> None:
    hostile.surface = "rpc:envelope"
    rng = random.Random(seed)
    peers = await start_swarm(1, "fuzz")
    try:
        async with hosts(4) as (*stages, attacker), local_pipeline(JOB, stages, max_in_flight=2) as services:
            peer = peers[0]
            attacker.add_addresses(peer.peer_id, peer.maddrs)
            ring = RingAllReduce(RpcEndpoint(stages[1], NS))
            await ring.start()
            try:
                targets: list[tuple[P2PTransport | Any, str, str, RpcMethod[Any, Any]]] = []
                for endpoint in [peer.rpc, *(s.rpc for s in services), ring.endpoint]:
                    for method in endpoint.served.values():
                        targets.append((endpoint.peer_id, endpoint.namespace, method.name, method))
                assert {t[2] for t in targets} >= EXPECTED_METHODS, {t[2] for t in targets}
                before = _state(services, ring)
                outcomes: dict[str, int] = {}
                for peer_id, namespace, name, method in targets:
                    qualified = f"ravnest/{namespace}/{name}"
                    for _ in range(per_method):
                        kind, data = hostile_message(method, rng)
                        stream = rng.random() < 0.25 or len(data) > (2 << 20)
                        hostile.sent += 1
                        try:
                            reply = await attacker.call(
                                peer_id, qualified, data, stream=stream, max_response_bytes=64 << 20
                            )
                            verdict = _verdict(bytes(reply))
                        except TransportError:
                            verdict = "no_reply"
                        outcomes[verdict] = outcomes.get(verdict, 0) + 1
                        assert verdict not in ("internal", "garbled"), (name, kind, verdict)
                        hostile.refused += verdict == "refused"
                    # and an absurd announced size on the stream path: refused from the prefix alone
                    reader, writer = await open_raw(attacker, peer_id, qualified + "/stream")
                    writer.write(FRAME_LEN.pack(rng.choice([2**64 - 1, method.max_request_bytes + 1])))
                    await writer.drain()
                    writer.write_eof()  # no body follows: the server must not wait for one
                    hostile.sent += 1
                    assert await until_closed(reader, 20.0), f"{name}: an absurd length left the stream open"
                    writer.close()
                    hostile.refused += 1
                # every target still serves, and nothing changed
                await attacker.call(
                    peer.peer_id,
                    f"ravnest/{peer.rpc.namespace}/ping",
                    encode_envelope({"kind": "request", "body": {}}),
                    stream=False,
                    max_response_bytes=4096,
                )
                for service in services[1:]:
                    await services[0].rpc.call(
                        service.rpc.peer_id, READY, ReadyRequest(epoch=1), timeout_s=10
                    )
                after = _state(services, ring)
                if after != before:
                    hostile.state_changes += 1
                assert after == before
                assert outcomes.get("no_reply", 0) < 0.05 * hostile.sent, outcomes
            finally:
                await ring.aclose()
    finally:
        await close_all(peers)


async def test_every_rpc_method_survives_hostile_envelopes(hostile):
    await _fuzz(hostile, per_method=45, seed=1)
    assert hostile.sent >= 400


@pytest.mark.slow
async def test_every_rpc_method_survives_many_hostile_envelopes(hostile):
    await _fuzz(hostile, per_method=400, seed=2)
    assert hostile.sent >= 3600
