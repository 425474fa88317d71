"""One tensor codec for every message: hivemind's tensor serialization plus optional compression.

Bytes from the network are checked *before* they become a tensor: the protobuf must parse, the dtype
and compression must be on an allow-list, the declared element count must be under a cap (so a forged
shape cannot make us allocate gigabytes) and the result must have the declared shape. Nothing here
unpickles: hivemind's tensor message is a protobuf with a raw buffer.

Compression bounds (per element, relative to the tensor's value range; see tests/unit/test_codec.py):
``fp16`` ~1e-3 relative; ``meanstd16`` ~1e-3 of the std; ``uniform8bit`` / ``quantile8bit`` ~1/256 of
the range. 8-bit decompression needs numpy < 2.4 (pinned in pyproject).

Speed: uncompressed tensors (most of our traffic) skip hivemind's object path, which copies the data four
or five times (``tobytes``, into the protobuf, out of it, ``bytearray``) and ran at ~90 MB/s here. We write
the same protobuf bytes ourselves, the ``buffer`` field first, then the other fields (protobuf allows
any order); reading, we slice the buffer field out of the bytes and parse only the small
rest; the tensor then uses the received frame's memory (or one copy of immutable bytes). Sending, the
data goes from the tensor straight into the envelope (`encode_tensor_parts`). Anything else
(compression, a buffer field that is not first or appears twice) takes hivemind's path, so both ends
stay wire-compatible with it.

Values: a decoded float tensor must be finite (`codec_values.within`: one pass, and what it proved is
remembered, so the receiving handler's magnitude check of the same tensor does not read it again).
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
import torch
from google.protobuf.message import DecodeError
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from ravnest_p2p.errors import CodecError
from ravnest_p2p.transport.codec_values import all_finite

__all__ = [
    "MAX_TENSOR_NUMEL",
    "Compression",
    "all_finite",
    "decode_tensor",
    "encode_tensor",
    "encode_tensor_parts",
]

# 2**31 elements is 8 GiB of fp32: no message of ours is ever near it; anything larger is forged.
MAX_TENSOR_NUMEL = 2**31


class Compression(StrEnum):
    NONE = "none"
    FP16 = "fp16"
    MEANSTD16 = "meanstd16"
    UNIFORM8BIT = "uniform8bit"
    QUANTILE8BIT = "quantile8bit"


_TO_PROTO = {
    Compression.NONE: runtime_pb2.CompressionType.NONE,
    Compression.FP16: runtime_pb2.CompressionType.FLOAT16,
    Compression.MEANSTD16: runtime_pb2.CompressionType.MEANSTD_16BIT,
    Compression.UNIFORM8BIT: runtime_pb2.CompressionType.UNIFORM_8BIT,
    Compression.QUANTILE8BIT: runtime_pb2.CompressionType.QUANTILE_8BIT,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}

_LOSSY_OK = {torch.float32, torch.float64, torch.float16}
_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
_ALLOWED_DTYPES = _FLOAT_DTYPES | {"int64", "int32", "int16", "int8", "uint8", "bool"}
_BUFFER_TAG = 0x0A  # field 1 (buffer), wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int] | None:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(view))):
        value |= (view[i] & 0x7F) << shift
        if not view[i] & 0x80:
            return value, i + 1
        shift += 7
    return None


def _encode_raw(tensor: torch.Tensor) -> list[bytes | memoryview]:
    """hivemind's uncompressed Tensor protobuf, as pieces: the data is a view, not a copy."""
    dtype_name = str(tensor.dtype).replace("torch.", "")
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    data = memoryview(raw.reshape(-1).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
    meta = runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE, size=list(tensor.shape), dtype=dtype_name
    ).SerializeToString()
    return [bytes((_BUFFER_TAG,)) + _varint(data.nbytes), data, meta]


def _parse(data: bytes | memoryview) -> tuple[runtime_pb2.Tensor, memoryview | None]:
    """The protobuf without its buffer plus a view of the buffer when it can be sliced out, else all of it."""
    view = memoryview(data).cast("B")
    proto = runtime_pb2.Tensor()
    try:
        if len(view) and view[0] == _BUFFER_TAG:
            header = _read_varint(view, 1)
            if header is not None and header[1] + header[0] <= len(view):
                length, start = header
                proto.ParseFromString(view[start + length :].tobytes())
                if not proto.buffer:  # a second buffer field would win over the first: take the slow path
                    return proto, view[start : start + length]
        proto.ParseFromString(view.tobytes())
    except (DecodeError, ValueError) as exc:
        raise CodecError(f"tensor bytes do not parse: {exc}") from None
    return proto, None


def encode_tensor(tensor: torch.Tensor, compression: Compression = Compression.NONE) -> bytes:
    """Serialize a CPU tensor; lossy compression applies to fp16/fp32/fp64 tensors only."""
    return b"".join(encode_tensor_parts(tensor, compression))


def encode_tensor_parts(
    tensor: torch.Tensor, compression: Compression = Compression.NONE
) -> list[bytes | memoryview]:
    """`encode_tensor` as pieces to concatenate, uncompressed data as a view of the tensor (no copy).

    The caller must join (or send) the pieces before it modifies the tensor.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype not in _LOSSY_OK:
        compression = Compression.NONE  # integers must stay exact; bfloat16 is already 2 bytes
    if compression is Compression.NONE:
        return _encode_raw(tensor)
    proto = serialize_torch_tensor(tensor, _TO_PROTO[compression])
    data: bytes = proto.SerializeToString()
    return [data]


def decode_tensor(
    data: bytes | memoryview,
    *,
    max_numel: int = MAX_TENSOR_NUMEL,
    require_finite: bool = True,
) -> torch.Tensor:
    """Parse and check bytes from the wire into a tensor.

    Raises:
        CodecError: malformed bytes, unknown dtype/compression, oversized or inconsistent shape,
            or (with ``require_finite``) NaN/inf values.
    """
    proto, buffer = _parse(data)
    buffer_bytes = len(buffer) if buffer is not None else len(proto.buffer)
    if proto.compression not in _FROM_PROTO:
        raise CodecError(f"unsupported compression {proto.compression}")
    if proto.dtype not in _ALLOWED_DTYPES:
        raise CodecError(f"unsupported dtype {proto.dtype!r}")
    if proto.compression != runtime_pb2.CompressionType.NONE and proto.dtype not in _FLOAT_DTYPES:
        raise CodecError("lossy compression is only valid for floating tensors")
    shape = tuple(int(d) for d in proto.size)
    if len(shape) > 8:
        raise CodecError(f"tensor rank {len(shape)} is too large")
    numel = 1
    for dim in shape:
        numel *= dim
    if numel > max_numel:
        raise CodecError(f"tensor of {numel} elements exceeds the limit of {max_numel}")
    if proto.compression == runtime_pb2.CompressionType.NONE and proto.dtype != "bfloat16":
        itemsize = torch.empty((), dtype=getattr(torch, proto.dtype)).element_size()
        if buffer_bytes != numel * itemsize:
            raise CodecError(
                f"buffer holds {buffer_bytes} bytes; {shape} of {proto.dtype} needs {numel * itemsize}"
            )
    try:
        if (
            buffer is not None
            and proto.compression == runtime_pb2.CompressionType.NONE
            and proto.dtype != "bfloat16"
        ):
            # A writable message (a frame we read into our own bytearray) is lent to the tensor as is;
            # an immutable one is copied once, so the tensor is always writable.
            owned = buffer if not buffer.readonly else bytearray(buffer)
            array = np.frombuffer(owned, dtype=np.dtype(proto.dtype))
            tensor = torch.from_numpy(array).reshape(shape)
        else:
            if buffer is not None:
                proto.buffer = buffer.tobytes()
            tensor = deserialize_torch_tensor(proto)
    except Exception as exc:  # hivemind raises whatever numpy/torch raise on inconsistent buffers
        raise CodecError(f"tensor bytes do not decode: {type(exc).__name__}: {exc}") from None
    if tuple(tensor.shape) != shape:
        raise CodecError(f"decoded shape {tuple(tensor.shape)} differs from declared {shape}")
    tensor = tensor.detach()
    if require_finite and tensor.is_floating_point() and not all_finite(tensor):
        raise CodecError("tensor has non-finite values")
    return tensor
