"""One set of limits: the largest message each bounded wire model accepts fits its envelope and method."""

from __future__ import annotations

import pytest

from ravnest_p2p.averaging.frames import MAX_HELLO_BYTES
from ravnest_p2p.averaging.messages import RING_STATUS, StatusReply, StreamHello
from ravnest_p2p.membership.gossip import (
    GOSSIP_VIEW,
    MAX_BUCKETS,
    MAX_ITEMS,
    GossipItem,
    GossipReply,
    GossipRequest,
)
from ravnest_p2p.transport.limits import GOSSIP_MAX_ITEMS, MAX_HEADER_BYTES, WireLimits
from ravnest_p2p.transport.wire import decode_envelope, encode_envelope

BIG = 2**62


def _item(i: int) -> GossipItem:
    pid = f"{i:08d}".ljust(128, "Z")  # the longest id the model accepts
    return GossipItem(peer_id=pid, version=123456789.123456, digest="f" * 16)


def _max_request() -> GossipRequest:
    return GossipRequest(
        epoch=BIG,
        view_digest="a" * 64,
        bucket_digests=("b" * 16,) * MAX_BUCKETS,
        push_buckets=tuple(range(MAX_BUCKETS - 1, -1, -1)),
        push=tuple(_item(i) for i in range(MAX_ITEMS)),
    )


def _max_reply() -> GossipReply:
    return GossipReply(
        epoch=BIG,
        view_digest="a" * 64,
        differing=tuple(range(MAX_BUCKETS - 1, -1, -1)),
        entries=tuple(_item(i) for i in range(MAX_ITEMS)),
    )


def _max_status() -> StatusReply:
    return StatusReply(alive=True, attempt=1000, done=True, members=["Q" * 128] * 1024)


@pytest.mark.parametrize(
    ("kind", "make", "method_cap"),
    [
        ("request", _max_request, GOSSIP_VIEW.max_request_bytes),
        ("response", _max_reply, GOSSIP_VIEW.max_response_bytes),
        ("response", _max_status, RING_STATUS.max_response_bytes),
    ],
)
def test_a_maximal_valid_message_fits_its_envelope_and_method(kind, make, method_cap):
    message = make()
    data = encode_envelope({"kind": kind, "body": message.model_dump(mode="json")})  # raises past the cap
    assert len(data) <= method_cap
    decoded = decode_envelope(data, max_bytes=method_cap)
    assert type(message).model_validate(decoded.header["body"]) == message


def test_one_more_gossip_item_is_refused_by_the_model_not_by_the_envelope():
    assert MAX_ITEMS == GOSSIP_MAX_ITEMS
    assert 500 < MAX_ITEMS < 20_000
    with pytest.raises(ValueError, match="at most"):
        GossipReply(epoch=0, view_digest="a" * 64, entries=tuple(_item(i) for i in range(MAX_ITEMS + 1)))


def test_the_header_cap_is_used_by_the_largest_gossip_message():
    """The derivation is not wastefully loose: a maximal request uses most of the header."""
    data = encode_envelope({"kind": "request", "body": _max_request().model_dump(mode="json")})
    assert len(data) > 0.95 * MAX_HEADER_BYTES


def test_a_maximal_ring_hello_fits():
    import msgpack

    hello = StreamHello(
        ring_id="r" * 128, epoch=BIG, round=BIG, attempt=1000, members_digest="m" * 64, chunks_digest="c" * 64
    )
    assert len(msgpack.packb(hello.model_dump(mode="json"), use_bin_type=True)) <= MAX_HELLO_BYTES


def test_frame_deadline_grows_with_size():
    limits = WireLimits(frame_floor_s=2.0, min_rate_bytes_per_s=1000.0)
    assert limits.frame_timeout_s(0) == 2.0
    assert limits.frame_timeout_s(10_000) == 12.0
