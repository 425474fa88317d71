"""A stage's training state keyed by global names, so it outlives the plan that split the model.

Problem. When the plan moves, a layer range gets a new owner, possibly cut at other points than before
(a new owner of layers [3, 7) may take them from the owners of [0, 5) and [5, 9), or from a replica in a
cluster split elsewhere). Torch's own ``optimizer.state_dict()`` keys per-parameter state by the
parameter's *position* in the optimizer, which means nothing once the split changes. So every tensor
here is named by its place in the whole model:

- ``<layer>.<attr>`` for parameters and buffers (`StageExecutor.parameters_by_name` /
  ``buffers_by_name``, e.g. ``3.weight``, ``5.running_mean``);
- ``optim/<param name>/<slot>`` for optimizer state: Adam/AdamW ``step``, ``exp_avg``, ``exp_avg_sq``;
  SGD ``momentum_buffer``;
- ``outer/<name>/<slot>`` for the outer optimizer's state of a parameter or buffer (`averaging/outer.py`:
  ``theta``, ``momentum``, ``residual``, fp32), when the stage has one: it lives with the shard's owner
  and moves with the stage. The averager registers it (`attach_extra_state`), so the hand-over, the
  snapshots and the checkpoints carry it with the same digest checks; the restore leaves it out of the
  executor (`outer_tensors` hands it to `ReplicaAverager.import_outer_state` before the averager starts).

Counters and the LR schedule position are a small JSON-able `StateMeta`. Every tensor has a digest (64
bits of sha256 of its bytes, the same function as `training.replicas.tensor_digests` for floating
tensors, so published stage digests can be checked against fetched state).

The names, `TensorEntry`, `StateMeta`, `StageState`, the digests and `merge_states` need no executor:
they live in `training.stage_state_types` and are re-exported here.

Restore is all-or-nothing: `check_state` validates every name, shape, dtype, digest and finiteness
against what the stage expects before `restore_state` changes anything. A stage is assembled from
several sources with `merge_states` (disjoint names; duplicates must carry the same digest; counters
must agree). Alternatives rejected: ``torch.save`` of the optimizer (pickle, positional keys); one blob
per stage (a different split could not take part of it).

Limits: one optimizer param group per stage (what `runtime.optim.build_optimizer` builds); gradients
accumulated towards an unfinished ``update_every`` step are not state (they are dropped on restore, as
`StageExecutor.load_state_dict` does); the global RNG is not captured (data order is the caller's
progress, see `StateMeta.progress`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping

from torch import Tensor

from ravnest_p2p.averaging.outer import OUTER_PREFIX, OUTER_SLOTS
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.stage_state_types import (
    _MAX_NAME_CHARS,
    OPTIM_PREFIX,
    StageState,
    StateMeta,
    StateMismatch,
    TensorEntry,
    _is_model,
    dtype_name,
    entries_digest,
    is_model_entry,
    layer_of,
    merge_states,
    names_in_layers,
    optim_name,
    outer_tensors,
    sources_for_range,
    tensor_digest,
)
from ravnest_p2p.transport.codec import all_finite

__all__ = [
    "OPTIM_PREFIX",
    "OUTER_PREFIX",
    "StageState",
    "StateMeta",
    "StateMismatch",
    "TensorEntry",
    "attach_extra_state",
    "capture_meta",
    "capture_state",
    "check_state",
    "dtype_name",
    "entries_digest",
    "expected_entries",
    "is_model_entry",
    "layer_of",
    "live_tensors",
    "merge_states",
    "names_in_layers",
    "optim_name",
    "outer_tensors",
    "restore_state",
    "sources_for_range",
    "tensor_digest",
]

_ADAM_SLOTS = ("step", "exp_avg", "exp_avg_sq")
_SGD_SLOTS = ("momentum_buffer",)
# executor -> more state tensors by global name (the outer optimizer's), read with the live ones
_EXTRA_STATE: weakref.WeakKeyDictionary[StageExecutor, Callable[[], Mapping[str, Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def attach_extra_state(executor: StageExecutor, provider: Callable[[], Mapping[str, Tensor]] | None) -> None:
    """Have `live_tensors(executor)` (the hand-over, snapshots, checkpoints) include `provider()`'s
    tensors (global names with a known prefix, e.g. the outer optimizer's); None detaches."""
    if provider is None:
        _EXTRA_STATE.pop(executor, None)
    else:
        _EXTRA_STATE[executor] = provider


def _slots(executor: StageExecutor) -> tuple[str, ...]:
    config = executor.config.optimizer
    if config.name in ("adam", "adamw"):
        return _ADAM_SLOTS
    return _SGD_SLOTS if config.momentum > 0 else ()


def expected_entries(executor: StageExecutor) -> dict[str, TensorEntry]:
    """Every name this stage can hold, with its shape and dtype (no digests): its state's schema."""
    out = {n: TensorEntry.of(n, t, digest=False) for n, t in executor.parameters_by_name().items()}
    out.update({n: TensorEntry.of(n, t, digest=False) for n, t in executor.buffers_by_name().items()})
    for name, param in executor.trainable_by_name().items():
        for slot in _slots(executor):
            shape = () if slot == "step" else tuple(param.shape)
            dtype = "float32" if slot == "step" else dtype_name(param.dtype)
            key = optim_name(name, slot)
            out[key] = TensorEntry(name=key, dtype=dtype, shape=shape)
    floating = {**executor.parameters_by_name(), **executor.buffers_by_name()}
    for name, tensor in floating.items():
        if tensor.is_floating_point():  # what an outer optimizer may hold (any subset of it)
            for slot in OUTER_SLOTS:
                key = f"{OUTER_PREFIX}{name}/{slot}"
                out[key] = TensorEntry(name=key, dtype="float32", shape=tuple(tensor.shape))
    return out


def live_tensors(executor: StageExecutor) -> dict[str, Tensor]:
    """The stage's state tensors by global name, as the live tensors themselves (no copies).

    Optimizer slots appear only once the optimizer has state for a parameter (after its first step);
    the outer optimizer's entries (copies) only while an averager has them attached.
    """
    out: dict[str, Tensor] = {n: p.detach() for n, p in executor.parameters_by_name().items()}
    out.update({n: b.detach() for n, b in executor.buffers_by_name().items()})
    optimizer = executor.optimizer
    if optimizer is not None:
        for name, param in executor.trainable_by_name().items():
            for slot, value in optimizer.state.get(param, {}).items():
                if isinstance(value, Tensor):
                    out[optim_name(name, slot)] = value.detach()
    extra = _EXTRA_STATE.get(executor)
    if extra is not None:
        out.update(extra())
    return out


def capture_meta(
    executor: StageExecutor, progress: Mapping[str, int | float | str] | None = None
) -> StateMeta:
    """The stage's counters and schedule position (plus the caller's `progress`)."""
    optimizer, scheduler = executor.optimizer, executor.scheduler
    fields: dict[str, object] = {"num_steps": executor.num_steps, "progress": dict(progress or {})}
    if optimizer is not None:
        fields["lrs"] = tuple(float(g["lr"]) for g in optimizer.param_groups)
    if scheduler is not None:
        fields.update(
            base_lrs=tuple(float(x) for x in scheduler.base_lrs),
            last_lrs=tuple(float(x) for x in scheduler.get_last_lr()),
            scheduler_last_epoch=int(scheduler.last_epoch),
            scheduler_step_count=int(getattr(scheduler, "_step_count", 0)),
        )
    return StateMeta.model_validate(fields)


def capture_state(
    executor: StageExecutor,
    names: Iterable[str] | None = None,
    *,
    progress: Mapping[str, int | float | str] | None = None,
    copy: bool = True,
) -> StageState:
    """A copy of the stage's state (all of it, or `names`), with digests and counters.

    Args:
        copy: clone the tensors (the default: the stage may train on). False takes the live tensors
            over, for a stage that will never step again: a second full copy of parameters and
            optimizer state is what OOM-killed the stages of `benchmarks/bench_big_model` at the end
            of their run.

    Raises:
        StateMismatch: a name the stage does not hold.
    """
    live = live_tensors(executor)
    wanted = list(live) if names is None else list(names)
    missing = [n for n in wanted if n not in live]
    if missing:
        raise StateMismatch(f"this stage holds no {missing[:5]}")
    tensors = {n: live[n].clone() if copy else live[n].detach() for n in wanted}
    return StageState(
        tensors=tensors,
        digests={n: tensor_digest(t) for n, t in tensors.items()},
        meta=capture_meta(executor, progress),
    )


def check_state(executor: StageExecutor, state: StageState, *, complete: bool = True) -> None:
    """Validate `state` for this stage without changing anything (see `restore_state`).

    Raises:
        StateMismatch: the first problem found.
    """
    expected = expected_entries(executor)
    for name, tensor in state.tensors.items():
        entry = expected.get(name)
        if entry is None:
            raise StateMismatch(f"{name[:_MAX_NAME_CHARS]!r} is not part of this stage")
        if tuple(tensor.shape) != entry.shape or dtype_name(tensor.dtype) != entry.dtype:
            raise StateMismatch(
                f"{name}: {dtype_name(tensor.dtype)}{tuple(tensor.shape)} != {entry.dtype}{entry.shape}"
            )
        if tensor.is_floating_point() and not all_finite(tensor):
            raise StateMismatch(f"{name} has non-finite values")
        digest = state.digests.get(name)
        if digest is None or tensor_digest(tensor) != digest:
            raise StateMismatch(f"{name}: digest does not match its bytes")
    slots = _slots(executor)
    for param in executor.trainable_by_name():
        present = [s for s in slots if optim_name(param, s) in state.tensors]
        if present and len(present) != len(slots):
            raise StateMismatch(f"optimizer state of {param} is partial: {present}")
    if complete:
        model_names = {n for n in expected if _is_model(n)}
        missing = sorted(model_names - set(state.tensors))
        if missing:
            raise StateMismatch(f"state lacks {len(missing)} tensors of this stage, e.g. {missing[:3]}")
        if state.meta is None:
            raise StateMismatch("a complete restore needs the counters (StateMeta)")
        with_optim = {
            p for p in executor.trainable_by_name() if slots and optim_name(p, slots[0]) in state.tensors
        }
        if with_optim and len(with_optim) != len(executor.trainable_by_name()):
            raise StateMismatch("optimizer state covers only some parameters of this stage")
    meta = state.meta
    if meta is not None and executor.optimizer is not None and meta.lrs:
        groups = len(executor.optimizer.param_groups)
        if len(meta.lrs) != groups or len(meta.base_lrs) not in (0, groups):
            raise StateMismatch(f"counters name {len(meta.lrs)} param groups; this stage has {groups}")


def restore_state(executor: StageExecutor, state: StageState, *, complete: bool = True) -> None:
    """Load `state` into the stage, all or nothing; drops pending gradients and the weight stash.

    With `complete` (a hand-over) the state must cover every parameter and buffer of the stage and carry
    counters; optimizer state is then exactly the given one (none given: fresh). Without it (e.g.
    fine-tuning from parameters only) just the given names change, plus the counters if given.

    Raises:
        StateMismatch: anything does not fit (nothing changed).
        RuntimeError: micro-batches are in flight (nothing changed).
    """
    if executor.in_flight:
        raise RuntimeError(f"cannot restore state with micro-batches in flight: {executor.in_flight}")
    check_state(executor, state, complete=complete)
    model = {n: t for n, t in state.tensors.items() if _is_model(n)}  # outer state: `outer_tensors`
    if model:
        executor.assign_parameters(model)
    optimizer = executor.optimizer
    if optimizer is not None:
        slots = _slots(executor)
        for name, param in executor.trainable_by_name().items():
            given = {
                s: state.tensors[optim_name(name, s)] for s in slots if optim_name(name, s) in state.tensors
            }
            if given:
                optimizer.state[param] = {s: t.detach().clone() for s, t in given.items()}
            elif complete:
                optimizer.state.pop(param, None)
    meta = state.meta
    if meta is not None:
        _restore_counters(executor, meta)


def _restore_counters(executor: StageExecutor, meta: StateMeta) -> None:
    optimizer, scheduler = executor.optimizer, executor.scheduler
    if optimizer is not None and meta.lrs:
        for group, lr, base in zip(optimizer.param_groups, meta.lrs, meta.base_lrs or meta.lrs, strict=False):
            group["lr"] = lr
            group["initial_lr"] = base
    if scheduler is not None and meta.base_lrs:
        scheduler.base_lrs = list(meta.base_lrs)
        scheduler.last_epoch = meta.scheduler_last_epoch
        scheduler._step_count = meta.scheduler_step_count  # type: ignore[attr-defined]
        scheduler._last_lr = list(meta.last_lrs or meta.lrs)  # type: ignore[attr-defined]
    executor.set_num_steps(meta.num_steps)
