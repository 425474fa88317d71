"""The Δ wire codecs: sizes, accuracy, and that a receiver trusts nothing in a payload."""

import struct

import pytest
import torch

from ravnest_p2p.averaging.deltawire import WireCodec
from ravnest_p2p.averaging.pseudograd import DeltaCompression
from ravnest_p2p.errors import InvalidMessage

INT8 = WireCodec(DeltaCompression.INT8, 64)
INT4 = WireCodec(DeltaCompression.INT4, 64)
SPARSE = WireCodec(DeltaCompression.TOPK, 64)


def values(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("codec", "levels"), [(INT8, 127), (INT4, 7)])
@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 1001])
def test_quantised_parts_have_the_exact_size_and_half_a_step_error(codec, levels, numel):
    x = values(numel)
    payload, decoded = codec.roundtrip(x)
    blocks = -(-numel // 64)
    data = numel if codec.kind is DeltaCompression.INT8 else -(-numel // 2)
    assert len(payload) == codec.max_bytes(numel) == 4 * blocks + data
    assert torch.equal(decoded, codec.decode(payload, numel))
    for b in range(blocks):
        chunk = x[64 * b : 64 * (b + 1)]
        step = chunk.abs().max() / levels
        assert (chunk - decoded[64 * b : 64 * (b + 1)]).abs().max() <= step / 2 + 1e-6


def test_sparse_parts_are_lossless_and_dense_when_that_is_smaller():
    x = torch.zeros(1000)
    x[[3, 10, 999]] = torch.tensor([1.5, -2.0, 3.25])
    payload = SPARSE.encode(x)
    assert len(payload) == 5 + 8 * 3
    assert torch.equal(SPARSE.decode(payload, 1000), x)
    dense = values(100)
    payload = SPARSE.encode(dense)
    assert len(payload) == 1 + 400
    assert torch.equal(SPARSE.decode(payload, 100), dense)


def test_a_zero_block_decodes_to_zeros():
    payload, decoded = INT8.roundtrip(torch.zeros(100))
    assert torch.equal(decoded, torch.zeros(100))
    assert len(payload) == 8 + 100


@pytest.mark.parametrize("codec", [INT8, INT4])
def test_wrong_size_or_bad_scales_are_refused(codec):
    payload = bytearray(codec.encode(values(100)))
    with pytest.raises(InvalidMessage):
        codec.decode(payload[:-1], 100)
    with pytest.raises(InvalidMessage):
        codec.decode(payload + b"\x00", 100)
    with pytest.raises(InvalidMessage):  # the size is the receiver's, never the sender's claim
        codec.decode(payload, 98)
    for bad in (float("nan"), float("inf"), -1.0):
        broken = bytearray(payload)
        broken[0:4] = struct.pack("<f", bad)
        with pytest.raises(InvalidMessage):
            codec.decode(broken, 100)
    huge = bytearray(payload)
    huge[0:4] = struct.pack("<f", 3e38)
    with pytest.raises(InvalidMessage):  # finite scale x code overflows
        codec.decode(huge, 100)


def test_codes_outside_the_range_are_refused():
    payload = bytearray(INT8.encode(values(10)))
    payload[4] = 0x80  # -128
    with pytest.raises(InvalidMessage):
        INT8.decode(payload, 10)
    payload = bytearray(INT4.encode(values(10)))
    payload[4] = 0x08 << 4  # low nibble 0 = code -8
    with pytest.raises(InvalidMessage):
        INT4.decode(payload, 10)


def test_sparse_indices_must_be_increasing_and_in_range():
    def sparse(indices, vals, count=None):
        count = len(indices) if count is None else count
        return (
            struct.pack("<BI", 1, count)
            + struct.pack(f"<{len(indices)}i", *indices)
            + struct.pack(f"<{len(vals)}f", *vals)
        )

    assert torch.equal(SPARSE.decode(sparse([1, 5], [1.0, 2.0]), 10)[[1, 5]], torch.tensor([1.0, 2.0]))
    for bad in (
        sparse([5, 1], [1.0, 2.0]),  # not increasing
        sparse([1, 1], [1.0, 2.0]),  # duplicate
        sparse([1, 10], [1.0, 2.0]),  # out of range
        sparse([-1, 2], [1.0, 2.0]),
        sparse([1, 2], [1.0, float("nan")]),
        sparse([1, 2], [1.0, 2.0], count=3),  # announced count does not match the size
        sparse(list(range(11)), [0.0] * 11),  # more entries than elements
        b"\x02",
        b"",
        b"\x00" + b"\x00" * 8,  # dense of the wrong size
    ):
        with pytest.raises(InvalidMessage):
            SPARSE.decode(bad, 10)
