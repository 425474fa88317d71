"""Checkpoint files on disk: safetensors written and read one tensor at a time, atomic JSON.

``safetensors.torch.save_file`` first turns every tensor into bytes (a second full copy of the state);
here each tensor goes from its own memory to the file. Reading checks the header against the tensors
the manifest lists (names, dtypes, shapes, contiguous offsets), the file's size and sha256, and reads
each tensor into its own buffer. The format is plain safetensors: any safetensors reader opens it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from ravnest_p2p.training.stage_state import TensorEntry, dtype_name

__all__ = ["CheckpointError", "atomic_json", "read_safetensors", "write_safetensors"]

_MAX_HEADER_BYTES = 100 << 20
_SKIP_CHUNK = 1 << 20
_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not match its manifest (nothing was loaded)."""


def _bytes_of(tensor: Tensor) -> memoryview:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def write_safetensors(
    path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]
) -> tuple[int, str]:
    """Write `tensors` (in name order) to `path`; returns (bytes, sha256). No copy of the whole state."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    names = sorted(tensors)
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype_name(tensor.dtype)],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    packed = json.dumps(header, separators=(",", ":")).encode()
    packed += b" " * (-len(packed) % 8)
    sha = hashlib.sha256()
    total = 0
    with open(path, "wb") as f:
        for head in (struct.pack("<Q", len(packed)), packed):
            f.write(head)
            sha.update(head)
            total += len(head)
        for name in names:  # one tensor at a time, from its own memory
            data = _bytes_of(tensors[name])
            f.write(data)
            sha.update(data)
            total += len(data)
        f.flush()
        os.fsync(f.fileno())
    return total, sha.hexdigest()


def read_safetensors(
    path: Path,
    tensors: Mapping[str, TensorEntry],
    *,
    file_bytes: int,
    file_sha256: str,
    keep: Collection[str] | None = None,
) -> dict[str, Tensor]:
    """Read a safetensors file whose header must list exactly `tensors`, of that size and sha256.

    With `keep`, only those tensors are returned; the others are still read (in chunks of at most
    `_SKIP_CHUNK` bytes) to check the file's sha256, but never held.
    """
    size = path.stat().st_size
    if size != file_bytes:
        raise CheckpointError(f"{path.name}: {size} bytes, the manifest says {file_bytes}")
    out: dict[str, Tensor] = {}
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        raw_len = f.read(8)
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path.name}: header length {header_len} out of range")
        raw_header = f.read(header_len)
        sha.update(raw_len)
        sha.update(raw_header)
        try:
            header = json.loads(raw_header)
        except ValueError as exc:
            raise CheckpointError(f"{path.name}: header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path.name}: header is not a map")
        header.pop("__metadata__", None)
        if set(header) != set(tensors):
            raise CheckpointError(f"{path.name}: tensors differ from the manifest's")
        offset = 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
            entry = tensors[name]
            if (
                not isinstance(info, dict)
                or _FROM_SAFETENSORS.get(info.get("dtype", "")) != entry.dtype
                or tuple(info.get("shape", ())) != entry.shape
                or info.get("data_offsets") != [offset, offset + entry.nbytes]
            ):
                raise CheckpointError(f"{path.name}: {name} is not laid out as the manifest says")
            offset += entry.nbytes
            if keep is not None and name not in keep:
                _hash_skipped(f, sha, entry.nbytes, f"{path.name}: truncated at {name}")
                continue
            data = bytearray(entry.nbytes)
            if f.readinto(data) != entry.nbytes:
                raise CheckpointError(f"{path.name}: truncated at {name}")
            sha.update(data)
            dtype = getattr(torch, entry.dtype)
            storage = torch.int16 if dtype == torch.bfloat16 else dtype
            tensor = torch.frombuffer(data, dtype=storage) if data else torch.empty(0, dtype=storage)
            tensor = tensor.view(dtype) if storage != dtype else tensor
            out[name] = tensor.reshape(entry.shape)
        if f.read(1):
            raise CheckpointError(f"{path.name}: bytes after the last tensor")
    if sha.hexdigest() != file_sha256:
        raise CheckpointError(f"{path.name}: sha256 differs from the manifest's")
    return out


def _hash_skipped(f: BinaryIO, sha: Any, nbytes: int, truncated: str) -> None:
    left = nbytes
    while left:
        chunk = f.read(min(left, _SKIP_CHUNK))
        if not chunk:
            raise CheckpointError(truncated)
        sha.update(chunk)
        left -= len(chunk)


def atomic_json(path: Path, value: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(value, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
