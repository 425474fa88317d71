import pytest
import torch

from ravnest_p2p.errors import CodecError
from ravnest_p2p.transport.codec import Compression, decode_tensor, encode_tensor
from ravnest_p2p.transport.wire import decode_envelope, encode_envelope

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
# max error relative to the tensor's std, per compression (for fp16/fp32/fp64 inputs)
LOSSY_BOUND = {
    Compression.NONE: 0.0,
    Compression.FP16: 2e-3,
    Compression.MEANSTD16: 5e-3,
    Compression.UNIFORM8BIT: 0.7,
    Compression.QUANTILE8BIT: 0.7,
}
MEAN_BOUND = {
    Compression.NONE: 0.0,
    Compression.FP16: 5e-4,
    Compression.MEANSTD16: 1e-3,
    Compression.UNIFORM8BIT: 0.1,
    Compression.QUANTILE8BIT: 0.1,
}


def sample(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(17, 33, generator=gen) * 3
    if dtype == torch.bool:
        return base > 0
    if not dtype.is_floating_point:
        return base.round().to(dtype) if dtype != torch.uint8 else base.abs().round().to(dtype)
    return base.to(dtype)


@pytest.mark.parametrize("compression", list(Compression))
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_and_compression(dtype, compression):
    tensor = sample(dtype)
    decoded = decode_tensor(encode_tensor(tensor, compression))
    assert decoded.dtype == tensor.dtype
    assert decoded.shape == tensor.shape
    exact = (
        not tensor.is_floating_point() or tensor.dtype == torch.bfloat16 or compression == Compression.NONE
    )
    if exact:
        assert torch.equal(decoded, tensor)
    else:
        err = (decoded.double() - tensor.double()).abs()
        std = tensor.double().std()
        assert err.max() <= LOSSY_BOUND[compression] * std * 3 + 1e-3
        assert err.mean() <= MEAN_BOUND[compression] * std * 3 + 1e-4


def test_empty_and_scalar_tensors():
    for tensor in (torch.zeros(0, 5), torch.tensor(3.5)):
        assert torch.equal(decode_tensor(encode_tensor(tensor)), tensor)


def test_garbage_bytes_are_a_codec_error():
    with pytest.raises(CodecError):
        decode_tensor(b"\xff\x00garbage\x12")


def _proto(tensor):
    from hivemind.proto import runtime_pb2

    proto = runtime_pb2.Tensor()
    proto.ParseFromString(encode_tensor(tensor))
    return proto


def test_forged_shape_larger_than_buffer_is_refused_without_allocating():
    proto = _proto(torch.ones(4))
    del proto.size[:]
    proto.size.extend([1 << 20, 1 << 20])  # 2^40 elements claimed
    with pytest.raises(CodecError, match="exceeds the limit"):
        decode_tensor(proto.SerializeToString())
    proto = _proto(torch.ones(4))
    del proto.size[:]
    proto.size.extend([8])
    with pytest.raises(CodecError, match="buffer holds"):
        decode_tensor(proto.SerializeToString())


@pytest.mark.parametrize("dtype", ["object", "O", "complex128", "<U8", ""])
def test_unlisted_dtypes_are_refused(dtype):
    proto = _proto(torch.ones(4))
    proto.dtype = dtype
    with pytest.raises(CodecError, match="dtype"):
        decode_tensor(proto.SerializeToString())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused_unless_allowed(bad):
    tensor = torch.ones(5)
    tensor[2] = bad
    data = encode_tensor(tensor)
    with pytest.raises(CodecError, match="non-finite"):
        decode_tensor(data)
    assert decode_tensor(data, require_finite=False).shape == (5,)


def test_envelope_round_trip_and_refusals():
    data = encode_envelope({"kind": "request", "body": {"x": 1}}, [b"abc", b"", b"de"])
    env = decode_envelope(data, max_bytes=1000)
    assert env.header["body"] == {"x": 1}
    assert env.blobs == [b"abc", b"", b"de"]
    from ravnest_p2p.errors import InvalidMessage, PayloadTooLarge

    with pytest.raises(PayloadTooLarge):
        decode_envelope(data, max_bytes=10)
    with pytest.raises(InvalidMessage):
        decode_envelope(b"XX" + data[2:], max_bytes=1000)
    with pytest.raises(InvalidMessage):
        decode_envelope(data[:-1], max_bytes=1000)  # blob sizes no longer add up
    with pytest.raises(InvalidMessage):
        decode_envelope(data[:9], max_bytes=1000)
