"""Checkpoints: a stage's (or a whole model's) state as safetensors plus a small JSON manifest.

Problem. A job must survive the loss of every peer that held a layer (no previous owner, no replica):
each stage writes its slice of the state every N optimizer steps or M seconds, and a full-swarm restart
resumes from the newest step that every layer range has a checkpoint of.

Format (see docs/checkpoints.md). ``step-<n>.safetensors`` holds the tensors by global name
(`training.stage_state`: parameters, buffers, ``optim/<param>/<slot>``); ``step-<n>.json`` is the
manifest: job id, a digest of the JobSpec, the step, the layer range, the caller's progress fields,
the counters (`StateMeta`) and every tensor's dtype, shape and digest, plus the data file's size and
sha256. Neither file is ever pickled. The safetensors file is written here from the live tensors, one
at a time (``safetensors.torch.save_file`` first copies every tensor to bytes: a second full copy of the
stage); readers may use any safetensors library. Writes are atomic (temporary file, fsync, rename; the
manifest last, so a checkpoint exists exactly when its manifest does); the newest ``keep_last`` stay.

Announcements. Every stage owner keeps one signed value under the run's ``checkpoints`` key: the job,
and the (step, layer range, manifest digest) of the checkpoints it keeps. `newest_complete` (pure)
finds the newest step whose ranges cover the whole model. Steps only line up across stages with
``every_steps`` (each stage saves when its own optimizer step count is a multiple of it); ``every_s``
checkpoints serve a single stage's recovery.

Limits: the stage's work waits while its checkpoint is written (the tensors are written live, without
a copy); the global RNG is not saved.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stage_state import (
    StageState,
    StateMeta,
    TensorEntry,
    dtype_name,
    tensor_digest,
)
from ravnest_p2p.types import WireModel

__all__ = [
    "CHECKPOINTS_KEY",
    "CheckpointAnnouncement",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManifest",
    "CheckpointRecord",
    "CheckpointWriter",
    "announce_checkpoints",
    "job_digest",
    "list_checkpoints",
    "load_checkpoint",
    "newest_complete",
    "read_announcements",
    "read_manifest",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINTS_KEY = "checkpoints"
_MAX_MANIFEST_BYTES = 32 << 20
_MAX_HEADER_BYTES = 100 << 20
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


class CheckpointConfig(BaseModel):
    """When and where a stage writes checkpoints.

    Attributes:
        every_steps: write when the stage's optimizer step count is a multiple of this (0: never).
        every_s: also write when this many seconds passed since the last one (0: never).
        keep_last: checkpoints kept per job and layer range (older ones are deleted).
        dir: root folder; files go to ``<dir>/<job id>/layers-<first>-<end>/``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    every_steps: int = Field(default=0, ge=0)
    every_s: float = Field(default=0.0, ge=0)
    keep_last: int = Field(default=3, ge=1, le=1000)
    dir: Path


def job_digest(job: JobSpec) -> str:
    """sha256 of the JobSpec's canonical JSON: ties a checkpoint to the job that wrote it."""
    canonical = json.dumps(job.to_wire(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class CheckpointManifest(BaseModel):
    """The JSON beside a checkpoint's safetensors file."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    schema_version: int = 1
    kind: str = Field(default="stage", pattern=r"^(stage|model)$")
    job_id: str = Field(max_length=64)
    job_digest: str = Field(max_length=64)
    job: dict[str, Any] | None = None  # the JobSpec itself (model checkpoints: what to rebuild)
    step: int = Field(ge=0)
    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1)
    progress: dict[str, int | float | str] = Field(default_factory=dict, max_length=64)
    meta: StateMeta | None = None
    file: str = Field(max_length=255)
    file_bytes: int = Field(ge=0)
    file_sha256: str = Field(max_length=64)
    tensors: dict[str, TensorEntry]
    created_at: float = 0.0

    def digest(self) -> str:
        """sha256 of the manifest's canonical JSON (what announcements name)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


# ----- safetensors, written and read one tensor at a time --------------------------------------------
def _bytes_of(tensor: Tensor) -> memoryview:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def _write_safetensors(
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


def _read_safetensors(path: Path, manifest: CheckpointManifest) -> dict[str, Tensor]:
    """Read a safetensors file whose header must list exactly the manifest's tensors."""
    size = path.stat().st_size
    if size != manifest.file_bytes:
        raise CheckpointError(f"{path.name}: {size} bytes, the manifest says {manifest.file_bytes}")
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
        if set(header) != set(manifest.tensors):
            raise CheckpointError(f"{path.name}: tensors differ from the manifest's")
        offset = 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
            entry = manifest.tensors[name]
            if (
                not isinstance(info, dict)
                or _FROM_SAFETENSORS.get(info.get("dtype", "")) != entry.dtype
                or tuple(info.get("shape", ())) != entry.shape
                or info.get("data_offsets") != [offset, offset + entry.nbytes]
            ):
                raise CheckpointError(f"{path.name}: {name} is not laid out as the manifest says")
            data = bytearray(entry.nbytes)
            if f.readinto(data) != entry.nbytes:
                raise CheckpointError(f"{path.name}: truncated at {name}")
            sha.update(data)
            offset += entry.nbytes
            dtype = getattr(torch, entry.dtype)
            storage = torch.int16 if dtype == torch.bfloat16 else dtype
            tensor = torch.frombuffer(data, dtype=storage) if data else torch.empty(0, dtype=storage)
            tensor = tensor.view(dtype) if storage != dtype else tensor
            out[name] = tensor.reshape(entry.shape)
        if f.read(1):
            raise CheckpointError(f"{path.name}: bytes after the last tensor")
    if sha.hexdigest() != manifest.file_sha256:
        raise CheckpointError(f"{path.name}: sha256 differs from the manifest's")
    return out


def _atomic_json(path: Path, value: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(value, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_checkpoint(
    directory: Path,
    tensors: Mapping[str, Tensor],
    *,
    job: JobSpec,
    step: int,
    first_layer: int,
    end_layer: int,
    meta: StateMeta | None = None,
    progress: Mapping[str, int | float | str] | None = None,
    kind: str = "stage",
    digests: Mapping[str, str] | None = None,
) -> Path:
    """Write ``step-<step>.safetensors`` + ``.json`` into `directory` atomically; returns the manifest path.

    `digests` (e.g. the ones a transfer already checked) skip hashing; they are trusted as given.
    """
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"step-{step:010d}"
    data_path, manifest_path = directory / f"{stem}.safetensors", directory / f"{stem}.json"
    tmp = directory / f".{stem}.safetensors.tmp-{os.getpid()}"
    try:
        file_bytes, file_sha = _write_safetensors(tmp, tensors, {"job_id": job.job_id, "step": str(step)})
        os.replace(tmp, data_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    entries = {
        n: TensorEntry(
            name=n,
            dtype=dtype_name(t.dtype),
            shape=tuple(t.shape),
            digest=(digests or {}).get(n) or tensor_digest(t),
        )
        for n, t in tensors.items()
    }
    manifest = CheckpointManifest(
        kind=kind,
        job_id=job.job_id,
        job_digest=job_digest(job),
        job=job.to_wire() if kind == "model" else None,
        step=step,
        first_layer=first_layer,
        end_layer=end_layer,
        progress=dict(progress or {}),
        meta=meta,
        file=data_path.name,
        file_bytes=file_bytes,
        file_sha256=file_sha,
        tensors=entries,
        created_at=time.time(),
    )
    _atomic_json(manifest_path, manifest.model_dump(mode="json"))
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return manifest_path


def read_manifest(path: Path) -> CheckpointManifest:
    """Parse a manifest file (size-capped)."""
    try:
        size = path.stat().st_size
        if size > _MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{path.name}: manifest of {size} bytes is too large")
        return CheckpointManifest.model_validate_json(path.read_bytes())
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: not a checkpoint manifest: {exc}") from None


def load_checkpoint(path: Path, *, job: JobSpec | None = None) -> tuple[CheckpointManifest, StageState]:
    """Load and verify a checkpoint given its manifest (``.json``) or data (``.safetensors``) path.

    Checks: the manifest parses; the data file's size and sha256; every tensor's name, dtype, shape
    (against the manifest) and digest; finite values; with `job`, the JobSpec digest.

    Raises:
        CheckpointError: any mismatch (nothing is returned).
    """
    manifest_path = path.with_suffix(".json")
    manifest = read_manifest(manifest_path)
    if job is not None and manifest.job_digest != job_digest(job):
        raise CheckpointError(f"{manifest_path.name} was written by another job spec")
    if Path(manifest.file).name != manifest.file:
        raise CheckpointError(f"{manifest_path.name}: data file {manifest.file!r} is not a plain name")
    try:
        tensors = _read_safetensors(manifest_path.parent / manifest.file, manifest)
    except OSError as exc:
        raise CheckpointError(f"{manifest.file}: {exc}") from None
    digests = {}
    for name, tensor in tensors.items():
        digest = tensor_digest(tensor)
        if digest != manifest.tensors[name].digest:
            raise CheckpointError(f"{name}: digest differs from the manifest's")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{name} has non-finite values")
        digests[name] = digest
    return manifest, StageState(tensors=tensors, digests=digests, meta=manifest.meta)


def list_checkpoints(directory: Path) -> list[Path]:
    """Manifest paths in `directory`, oldest step first (unreadable names skipped)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("step-*.json") if p.stem[5:].isdigit())


def _prune(directory: Path, keep_last: int) -> None:
    for manifest_path in list_checkpoints(directory)[:-keep_last]:
        manifest_path.unlink(missing_ok=True)  # the checkpoint ceases to exist first
        manifest_path.with_suffix(".safetensors").unlink(missing_ok=True)


class CheckpointWriter:
    """Writes one stage's checkpoints when due (`due`, `save`) and keeps the newest `keep_last`."""

    def __init__(self, config: CheckpointConfig, job: JobSpec, *, first_layer: int, end_layer: int) -> None:
        self.config = config
        self.job = job
        self.first_layer = first_layer
        self.end_layer = end_layer
        self.directory = config.dir / job.job_id / f"layers-{first_layer}-{end_layer}"
        self._last_save = time.monotonic()
        self._last_step: int | None = None

    def due(self, step: int) -> bool:
        if step == self._last_step:
            return False
        if self.config.every_steps and step % self.config.every_steps == 0:
            return True
        return bool(self.config.every_s) and time.monotonic() - self._last_save >= self.config.every_s

    def save(
        self,
        state: StageState | Mapping[str, Tensor],
        *,
        step: int,
        meta: StateMeta | None = None,
        progress: Mapping[str, int | float | str] | None = None,
    ) -> CheckpointManifest:
        """Write a checkpoint of `state` (a `StageState`, or live tensors by name) and prune old ones."""
        tensors = state.tensors if isinstance(state, StageState) else state
        meta = state.meta if isinstance(state, StageState) and meta is None else meta
        path = write_checkpoint(
            self.directory,
            tensors,
            job=self.job,
            step=step,
            first_layer=self.first_layer,
            end_layer=self.end_layer,
            meta=meta,
            progress=progress,
        )
        self._last_save, self._last_step = time.monotonic(), step
        _prune(self.directory, self.config.keep_last)
        return read_manifest(path)

    def saved(self) -> list[CheckpointManifest]:
        return [read_manifest(p) for p in list_checkpoints(self.directory)]


# ----- announcements ------------------------------------------------------------------------------------
class CheckpointRecord(WireModel):
    step: int = Field(ge=0)
    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1)
    manifest_digest: str = Field(min_length=1, max_length=64)


class CheckpointAnnouncement(WireModel):
    """A stage owner's checkpoints of a job, under its own signed subkey of ``checkpoints``."""

    schema_version: int = 1
    job_id: str = Field(max_length=64)
    job_digest: str = Field(max_length=64)
    peer_id: str = Field(max_length=128)
    checkpoints: tuple[CheckpointRecord, ...] = Field(default=(), max_length=64)
    updated_at: float = 0.0

    @classmethod
    def of(
        cls, manifests: Iterable[CheckpointManifest], *, peer_id: str, updated_at: float
    ) -> CheckpointAnnouncement:
        listed = list(manifests)
        assert listed, "announce at least one checkpoint"
        return cls(
            job_id=listed[0].job_id,
            job_digest=listed[0].job_digest,
            peer_id=peer_id,
            checkpoints=tuple(
                CheckpointRecord(
                    step=m.step, first_layer=m.first_layer, end_layer=m.end_layer, manifest_digest=m.digest()
                )
                for m in listed[-64:]
            ),
            updated_at=updated_at,
        )


def newest_complete(
    announcements: Sequence[CheckpointAnnouncement],
    *,
    job_id: str,
    num_layers: int,
    job_digest: str | None = None,
) -> tuple[int, list[tuple[str, CheckpointRecord]]] | None:
    """The newest step whose checkpoints cover layers [0, num_layers), and who holds them.

    Returns (step, [(peer id, record), ...]) with records chosen to cover the model (first by layer,
    the widest range first), or None when no step is complete. Pure.
    """
    by_step: dict[int, list[tuple[str, CheckpointRecord]]] = {}
    for announcement in announcements:
        if announcement.job_id != job_id or (
            job_digest is not None and announcement.job_digest != job_digest
        ):
            continue
        for record in announcement.checkpoints:
            if record.end_layer > record.first_layer:
                by_step.setdefault(record.step, []).append((announcement.peer_id, record))
    for step in sorted(by_step, reverse=True):
        chosen: list[tuple[str, CheckpointRecord]] = []
        covered = 0
        while covered < num_layers:
            candidates = [h for h in by_step[step] if h[1].first_layer <= covered < h[1].end_layer]
            if not candidates:
                break
            best = max(candidates, key=lambda h: (h[1].end_layer, h[0]))
            chosen.append(best)
            covered = best[1].end_layer
        if covered >= num_layers:
            return step, chosen
    return None


class _SignedStore(Protocol):
    async def store_own(self, name: str, value: Any, *, ttl_s: float) -> bool: ...

    async def get_signed(self, name: str) -> dict[str, tuple[Any, float]]: ...


async def announce_checkpoints(
    dht: _SignedStore, announcement: CheckpointAnnouncement, *, ttl_s: float = 3600.0
) -> bool:
    """Store `announcement` under our own signed subkey of ``checkpoints``; True if a replica took it."""
    return await dht.store_own(CHECKPOINTS_KEY, announcement.model_dump(mode="json"), ttl_s=ttl_s)


async def read_announcements(dht: _SignedStore, *, job_id: str | None = None) -> list[CheckpointAnnouncement]:
    """Valid announcements (of `job_id`), each signed by the peer it names; malformed ones are dropped."""
    out = []
    for signer, (value, _) in (await dht.get_signed(CHECKPOINTS_KEY)).items():
        try:
            announcement = CheckpointAnnouncement.model_validate(value)
        except Exception as exc:
            logger.debug("ignoring a malformed checkpoint announcement from %s: %s", signer, exc)
            continue
        if announcement.peer_id == signer and (job_id is None or announcement.job_id == job_id):
            out.append(announcement)
    return out
