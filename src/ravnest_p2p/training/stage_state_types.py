"""A stage state's names, entries and containers: pure data, no executor (see `training.stage_state`).

The global names (``<layer>.<attr>``, ``optim/<param>/<slot>``, ``outer/<name>/<slot>``) and what
they tell (`layer_of`, `names_in_layers`, `is_model_entry`, `outer_tensors`), who holds which part of
a layer range (`sources_for_range`), the per-tensor and whole-state digests, the announced shape of a
tensor (`TensorEntry`), the counters (`StateMeta`), the state itself (`StageState`) and how states
from several sources combine (`merge_states`).

Why separate: `stage_state.py` reads, captures, checks and restores the state of a live
`StageExecutor`; this half needs no executor, so each module stays small. `training.stage_state`
re-exports every public name here, so callers import from either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from ravnest_p2p.averaging.outer import OUTER_PREFIX

__all__ = [
    "OPTIM_PREFIX",
    "StageState",
    "StateMeta",
    "StateMismatch",
    "TensorEntry",
    "dtype_name",
    "entries_digest",
    "is_model_entry",
    "layer_of",
    "merge_states",
    "names_in_layers",
    "optim_name",
    "outer_tensors",
    "sources_for_range",
    "tensor_digest",
]

OPTIM_PREFIX = "optim/"
_MAX_NAME_CHARS = 256


class StateMismatch(ValueError):
    """A state does not fit the stage (name, shape, dtype, digest, counters); nothing was changed."""


def optim_name(param_name: str, slot: str) -> str:
    """Global name of one optimizer slot of one parameter, e.g. ``optim/3.weight/exp_avg``."""
    return f"{OPTIM_PREFIX}{param_name}/{slot}"


def _split_optim(name: str) -> tuple[str, str] | None:
    if not name.startswith(OPTIM_PREFIX):
        return None
    param, _, slot = name[len(OPTIM_PREFIX) :].rpartition("/")
    return (param, slot) if param and slot else None


def _split_outer(name: str) -> tuple[str, str] | None:
    if not name.startswith(OUTER_PREFIX):
        return None
    param, _, slot = name[len(OUTER_PREFIX) :].rpartition("/")
    return (param, slot) if param and slot else None


def is_model_entry(name: str) -> bool:
    """A parameter or buffer (not optimizer or outer-optimizer state)."""
    return _split_optim(name) is None and _split_outer(name) is None


_is_model = is_model_entry


def outer_tensors(state: StageState) -> dict[str, Tensor]:
    """The outer optimizer's entries of `state` (``outer/...``), for `ReplicaAverager.import_outer_state`."""
    return {n: t for n, t in state.tensors.items() if _split_outer(n) is not None}


def layer_of(name: str) -> int:
    """The model layer a state name belongs to (``optim/5.weight/step`` -> 5).

    Raises:
        StateMismatch: the name does not start with a layer index.
    """
    prefixed = _split_optim(name) or _split_outer(name)
    head = (prefixed[0] if prefixed else name).partition(".")[0]
    if not head.isdigit() or len(head) > 9:
        raise StateMismatch(f"{name[:_MAX_NAME_CHARS]!r} is not a global state name")
    return int(head)


def names_in_layers(names: Iterable[str], first_layer: int, end_layer: int) -> list[str]:
    """The names among `names` of layers [first_layer, end_layer), in the given order."""
    return [n for n in names if first_layer <= layer_of(n) < end_layer]


def sources_for_range(
    first_layer: int, end_layer: int, owners: Sequence[tuple[str, int, int]]
) -> list[tuple[str, int, int]]:
    """Who holds which part of [first_layer, end_layer): (peer id, first, end) pieces, in layer order.

    `owners` are (peer id, first, end) of one previous split (e.g. one cluster's stages). Pure.

    Raises:
        ValueError: the owners do not cover the range.
    """
    pieces = []
    for peer_id, first, end in sorted(owners, key=lambda o: o[1]):
        lo, hi = max(first, first_layer), min(end, end_layer)
        if lo < hi:
            pieces.append((peer_id, lo, hi))
    covered = first_layer
    for _, lo, hi in pieces:
        if lo > covered:
            break
        covered = max(covered, hi)
    if covered < end_layer:
        raise ValueError(f"layers [{covered}, {end_layer}) have no owner among {len(owners)}")
    return pieces


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_digest(tensor: Tensor) -> str:
    """64 bits of sha256 of a tensor's bytes (equal to `replicas.tensor_digests` for floating tensors)."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    view = memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
    return hashlib.sha256(view).hexdigest()[:16]


class TensorEntry(BaseModel):
    """What one named tensor is: announced by a sender, checked by a receiver before it allocates."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=_MAX_NAME_CHARS)
    dtype: str = Field(max_length=16)
    shape: tuple[int, ...] = Field(max_length=8)
    digest: str = Field(default="", max_length=64)

    @property
    def numel(self) -> int:
        out = 1
        for dim in self.shape:
            out *= dim
        return out

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @classmethod
    def of(cls, name: str, tensor: Tensor, *, digest: bool = True) -> TensorEntry:
        return cls(
            name=name,
            dtype=dtype_name(tensor.dtype),
            shape=tuple(tensor.shape),
            digest=tensor_digest(tensor) if digest else "",
        )


class StateMeta(BaseModel):
    """Counters and the LR schedule position of a stage (JSON-able; travels with its tensors).

    Attributes:
        num_steps: optimizer steps the stage has taken.
        lrs: the optimizer's current learning rate per param group (what the next step uses).
        base_lrs / last_lrs / scheduler_last_epoch / scheduler_step_count: the LR scheduler's state.
        progress: the caller's fields (e.g. samples, data position); not used by restore.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    schema_version: int = 1
    num_steps: int = Field(ge=0)
    lrs: tuple[float, ...] = Field(default=(), max_length=16)
    base_lrs: tuple[float, ...] = Field(default=(), max_length=16)
    last_lrs: tuple[float, ...] = Field(default=(), max_length=16)
    scheduler_last_epoch: int = Field(default=0, ge=-1)
    scheduler_step_count: int = Field(default=0, ge=0)
    progress: dict[str, int | float | str] = Field(default_factory=dict, max_length=64)

    def counters(self) -> StateMeta:
        """This meta without the caller's progress (what restore uses and merge compares)."""
        return self.model_copy(update={"progress": {}})


@dataclasses.dataclass(frozen=True)
class StageState:
    """Named tensors (global names), their digests, and the stage's counters (None: tensors only)."""

    tensors: dict[str, Tensor]
    digests: dict[str, str]
    meta: StateMeta | None = None

    def subset(self, names: Iterable[str]) -> StageState:
        """The state of `names` only (KeyError on a name it does not hold)."""
        wanted = list(names)
        return StageState(
            tensors={n: self.tensors[n] for n in wanted},
            digests={n: self.digests[n] for n in wanted},
            meta=self.meta,
        )

    def entries(self) -> dict[str, TensorEntry]:
        return {
            n: TensorEntry(name=n, dtype=dtype_name(t.dtype), shape=tuple(t.shape), digest=self.digests[n])
            for n, t in self.tensors.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def entries_digest(entries: Iterable[TensorEntry]) -> str:
    """sha256 over every (name, dtype, shape, digest), sorted by name: one digest for a whole state."""
    rows = sorted((e.name, e.dtype, list(e.shape), e.digest) for e in entries)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def merge_states(parts: Sequence[StageState], *, meta: StateMeta | None = None) -> StageState:
    """One state from several sources (e.g. the two previous owners of a new owner's layers).

    Names must be disjoint, or carry the same digest. Counters (`StateMeta` without progress) must agree
    unless `meta` is given, which then wins.

    Raises:
        StateMismatch: two sources disagree.
    """
    tensors: dict[str, Tensor] = {}
    digests: dict[str, str] = {}
    for part in parts:
        for name, tensor in part.tensors.items():
            if name in digests and digests[name] != part.digests[name]:
                raise StateMismatch(f"sources disagree on {name}")
            tensors[name], digests[name] = tensor, part.digests[name]
    if meta is None:
        metas = [p.meta for p in parts if p.meta is not None]
        if any(m.counters() != metas[0].counters() for m in metas[1:]):
            raise StateMismatch(f"sources are at different steps: {sorted({m.num_steps for m in metas})}")
        meta = metas[0] if metas else None
    return StageState(tensors=tensors, digests=digests, meta=meta)
