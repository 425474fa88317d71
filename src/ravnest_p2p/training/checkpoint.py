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

Modules: ``checkpoint_files`` (the safetensors I/O), ``checkpoint_announce`` (announcements; re-exported
here), ``checkpoint_fetch`` (fetching checkpoints from the peers that wrote them).

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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import safe_open
from torch import Tensor

from ravnest_p2p.training.checkpoint_announce import (
    CHECKPOINTS_KEY,
    CheckpointAnnouncement,
    CheckpointRecord,
    announce_checkpoints,
    complete_steps,
    newest_complete,
    newest_covering,
    parse_announcement,
    read_announcements,
)
from ravnest_p2p.training.checkpoint_files import (
    CheckpointError,
    atomic_json,
    read_safetensors,
    write_safetensors,
)
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stage_state import (
    StageState,
    StateMeta,
    StateMismatch,
    TensorEntry,
    dtype_name,
    names_in_layers,
    tensor_digest,
)

__all__ = [
    "CHECKPOINTS_KEY",
    "CheckpointAnnouncement",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointFileSource",
    "CheckpointManifest",
    "CheckpointRecord",
    "CheckpointWriter",
    "announce_checkpoints",
    "checkpoint_manifest_path",
    "complete_steps",
    "job_digest",
    "list_checkpoints",
    "load_checkpoint",
    "newest_complete",
    "newest_covering",
    "parse_announcement",
    "read_announcements",
    "read_manifest",
    "write_checkpoint",
    "write_checkpoint_file",
]

logger = logging.getLogger(__name__)

_MAX_MANIFEST_BYTES = 32 << 20


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


# JobSpec fields that say where the job runs, not what it is: a checkpoint written on one plan must
# resume the job on any other (the supervisor hands its runner the job with the plan's assignment)
_PLACEMENT_FIELDS = frozenset({"assignment"})


def job_digest(job: JobSpec) -> str:
    """sha256 of the JobSpec's canonical JSON without its placement (`_PLACEMENT_FIELDS`): ties a
    checkpoint to the job that wrote it, on whatever plan it was written."""
    identity = {k: v for k, v in job.to_wire().items() if k not in _PLACEMENT_FIELDS}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
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
    return write_checkpoint_file(
        directory / f"step-{step:010d}.safetensors",
        tensors,
        job=job,
        step=step,
        first_layer=first_layer,
        end_layer=end_layer,
        meta=meta,
        progress=progress,
        kind=kind,
        digests=digests,
    )


def write_checkpoint_file(
    data_path: Path,
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
    """`write_checkpoint` to a given ``<name>.safetensors`` (manifest: ``<name>.json``); the manifest path."""
    directory = data_path.parent
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = data_path.with_suffix(".json")
    tmp = directory / f".{data_path.name}.tmp-{os.getpid()}"
    try:
        file_bytes, file_sha = write_safetensors(tmp, tensors, {"job_id": job.job_id, "step": str(step)})
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
    atomic_json(manifest_path, manifest.model_dump(mode="json"))
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


def load_checkpoint(
    path: Path,
    *,
    job: JobSpec | None = None,
    manifest_digest: str | None = None,
    layers: tuple[int, int] | None = None,
) -> tuple[CheckpointManifest, StageState]:
    """Load and verify a checkpoint given its manifest (``.json``) or data (``.safetensors``) path.

    Checks: the manifest parses (and, given `manifest_digest`, e.g. from an announcement, is that one);
    the data file's size and sha256; every tensor's name, dtype, shape (against the manifest) and
    digest; finite values; with `job`, the JobSpec digest. Files are read one tensor at a time; with
    `layers` (first, end), only the tensors of those layers are kept (the rest is hashed, not held).

    Raises:
        CheckpointError: any mismatch (nothing is returned).
    """
    manifest_path = path.with_suffix(".json")
    manifest = read_manifest(manifest_path)
    if manifest_digest is not None and manifest.digest() != manifest_digest:
        raise CheckpointError(f"{manifest_path.name} is not the announced manifest")
    if job is not None and manifest.job_digest != job_digest(job):
        raise CheckpointError(f"{manifest_path.name} was written by another job spec")
    if Path(manifest.file).name != manifest.file:
        raise CheckpointError(f"{manifest_path.name}: data file {manifest.file!r} is not a plain name")
    try:
        keep = None if layers is None else set(names_in_layers(manifest.tensors, *layers))
    except StateMismatch as exc:
        raise CheckpointError(f"{manifest_path.name}: {exc}") from None
    try:
        tensors = read_safetensors(
            manifest_path.parent / manifest.file,
            manifest.tensors,
            file_bytes=manifest.file_bytes,
            file_sha256=manifest.file_sha256,
            keep=keep,
        )
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


class _LazyTensors(Mapping[str, Tensor]):
    """A checkpoint's tensors, each read from the file when asked for (nothing held)."""

    def __init__(self, manifest: CheckpointManifest, data_path: Path) -> None:
        self._manifest = manifest
        self._data_path = data_path
        self._offsets: dict[str, int] | None = None  # where each tensor's bytes start in the file

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._manifest.tensors:
            raise KeyError(name)
        with safe_open(str(self._data_path), framework="pt") as f:
            tensor: Tensor = f.get_tensor(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._manifest.tensors)

    def __len__(self) -> int:
        return len(self._manifest.tensors)

    def read_range(self, name: str, start: int, count: int) -> Tensor:
        """Elements [start, start + count) of a tensor, flattened: read from the file, nothing else held.

        Offsets come from the manifest (the file is laid out in name order, as `write_safetensors`
        writes it); the reader checks the digest of what arrives, so a damaged file is caught there.
        """
        entries = self._manifest.tensors
        if name not in entries:
            raise KeyError(name)
        if self._offsets is None:
            with open(self._data_path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
            offset, self._offsets = 8 + header_len, {}
            for key in sorted(entries):
                self._offsets[key] = offset
                offset += entries[key].nbytes
        entry = entries[name]
        if start < 0 or count < 0 or start + count > entry.numel:
            raise ValueError(f"{name}: elements [{start}, {start + count}) outside its {entry.numel}")
        dtype = getattr(torch, entry.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        data = bytearray(count * size)
        with open(self._data_path, "rb") as f:
            if os.preadv(f.fileno(), [data], self._offsets[name] + start * size) != len(data):
                raise CheckpointError(f"{self._data_path.name}: truncated at {name}")
        storage = torch.int16 if dtype == torch.bfloat16 else dtype
        tensor = torch.frombuffer(data, dtype=storage) if data else torch.empty(0, dtype=storage)
        return tensor.view(dtype) if storage != dtype else tensor


class CheckpointFileSource:
    """A checkpoint on this peer's disk as a `handover.StateSource`: tensors read one at a time.

    Its listing gives the manifest's digests (so a receiver checks the file's bytes against what was
    written, not against a hash of possibly damaged bytes), its version is the manifest's digest.
    """

    def __init__(self, manifest_path: Path) -> None:
        self.manifest_path = manifest_path
        self.manifest = read_manifest(manifest_path)
        if Path(self.manifest.file).name != self.manifest.file:
            raise CheckpointError(
                f"{manifest_path.name}: data file {self.manifest.file!r} is not a plain name"
            )
        self._tensors = _LazyTensors(self.manifest, manifest_path.parent / self.manifest.file)
        self._version = self.manifest.digest()

    def tensors(self) -> Mapping[str, Tensor]:
        return self._tensors

    def read_range(self, name: str, start: int, count: int) -> Tensor:
        """A page of one tensor straight from the file (`handover_server` serves pages with it)."""
        return self._tensors.read_range(name, start, count)

    def entries(self) -> Mapping[str, TensorEntry]:
        return self.manifest.tensors

    def meta(self) -> StateMeta | None:
        return self.manifest.meta

    def version(self) -> str:
        return self._version


def checkpoint_manifest_path(root: Path, job_id: str, *, step: int, first_layer: int, end_layer: int) -> Path:
    """Where a stage checkpoint's manifest lives under a `CheckpointConfig.dir`."""
    return root / job_id / f"layers-{first_layer}-{end_layer}" / f"step-{step:010d}.json"


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
        self.directory = checkpoint_manifest_path(
            config.dir, job.job_id, step=0, first_layer=first_layer, end_layer=end_layer
        ).parent
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
