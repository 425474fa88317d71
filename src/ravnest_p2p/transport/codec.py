"""One tensor codec for every message: hivemind's tensor serialization plus optional compression.

Bytes from the network are checked *before* they become a tensor: the protobuf must parse, the dtype
and compression must be on an allow-list, the declared element count must be under a cap (so a forged
shape cannot make us allocate gigabytes) and the result must have the declared shape. Nothing here
unpickles: hivemind's tensor message is a protobuf with a raw buffer.

Compression bounds (per element, relative to the tensor's value range; see tests/unit/test_codec.py):
``fp16`` ~1e-3 relative; ``meanstd16`` ~1e-3 of the std; ``uniform8bit`` / ``quantile8bit`` ~1/256 of
the range. 8-bit decompression needs numpy < 2.4 (pinned in pyproject).
"""

from __future__ import annotations

from enum import StrEnum

import torch
from google.protobuf.message import DecodeError
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from ravnest_p2p.errors import CodecError

__all__ = ["MAX_TENSOR_NUMEL", "Compression", "decode_tensor", "encode_tensor"]

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


def encode_tensor(tensor: torch.Tensor, compression: Compression = Compression.NONE) -> bytes:
    """Serialize a CPU tensor; lossy compression applies to fp16/fp32/fp64 tensors only."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype not in _LOSSY_OK:
        compression = Compression.NONE  # integers must stay exact; bfloat16 is already 2 bytes
    proto = serialize_torch_tensor(tensor, _TO_PROTO[compression])
    data: bytes = proto.SerializeToString()
    return data


def decode_tensor(
    data: bytes,
    *,
    max_numel: int = MAX_TENSOR_NUMEL,
    require_finite: bool = True,
) -> torch.Tensor:
    """Parse and check bytes from the wire into a tensor.

    Raises:
        CodecError: malformed bytes, unknown dtype/compression, oversized or inconsistent shape,
            or (with ``require_finite``) NaN/inf values.
    """
    proto = runtime_pb2.Tensor()
    try:
        proto.ParseFromString(data)
    except (DecodeError, ValueError) as exc:
        raise CodecError(f"tensor bytes do not parse: {exc}") from None
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
        if len(proto.buffer) != numel * itemsize:
            raise CodecError(
                f"buffer holds {len(proto.buffer)} bytes; {shape} of {proto.dtype} needs {numel * itemsize}"
            )
    try:
        tensor = deserialize_torch_tensor(proto)
    except Exception as exc:  # hivemind raises whatever numpy/torch raise on inconsistent buffers
        raise CodecError(f"tensor bytes do not decode: {type(exc).__name__}: {exc}") from None
    if tuple(tensor.shape) != shape:
        raise CodecError(f"decoded shape {tuple(tensor.shape)} differs from declared {shape}")
    tensor = tensor.detach()
    if require_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise CodecError("tensor has non-finite values")
    return tensor
