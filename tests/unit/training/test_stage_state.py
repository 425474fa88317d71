"""Stage state by global name: exact round trips, restores across different splits, all-or-nothing checks."""

from __future__ import annotations

import pytest
import torch

from ravnest_p2p.training.replicas import tensor_digests
from ravnest_p2p.training.stage_state import (
    StateMismatch,
    capture_state,
    expected_entries,
    merge_states,
    names_in_layers,
    restore_state,
    sources_for_range,
    tensor_digest,
)

from .stage_state_helpers import (
    ADAM,
    SGD,
    assert_bit_equal,
    build_split,
    resnet_job,
    train_step,
    union_state,
)


@pytest.mark.parametrize("optimizer", [ADAM, SGD], ids=["adam-cosine", "sgd-momentum"])
def test_restored_stage_trains_one_step_bit_for_bit_like_the_original(optimizer):
    job = resnet_job(optimizer)
    [original] = build_split(job, [(0, 5)])
    for seed in range(3):
        train_step([original], seed)
    state = capture_state(original)
    assert any(n.startswith("optim/") for n in state.tensors)
    assert state.meta is not None
    assert state.meta.num_steps == 3

    [restored] = build_split(job, [(0, 5)])
    restore_state(restored, state)
    assert restored.num_steps == 3
    assert restored.optimizer.param_groups[0]["lr"] == original.optimizer.param_groups[0]["lr"]
    assert_bit_equal(union_state([original]), union_state([restored]))

    loss_a, loss_b = train_step([original], 10), train_step([restored], 10)
    assert loss_a == loss_b
    assert_bit_equal(union_state([original]), union_state([restored]))
    assert original.scheduler.get_last_lr() == restored.scheduler.get_last_lr()


def test_optimizer_state_survives_a_change_of_split():
    """Train split A, move the state to split B (new owners take layers from two old ones), train on."""
    job = resnet_job()
    old = build_split(job, [(0, 2), (2, 5)])
    for seed in range(3):
        train_step(old, seed)
    captured = [capture_state(s) for s in old]

    new = build_split(job, [(0, 3), (3, 5)])
    owners = [("a", 0, 2), ("b", 2, 5)]
    for stage, (first, end) in zip(new, [(0, 3), (3, 5)], strict=True):
        parts = []
        for peer, lo, hi in sources_for_range(first, end, owners):
            source = captured[0] if peer == "a" else captured[1]
            parts.append(source.subset(names_in_layers(source.tensors, lo, hi)))
        restore_state(stage, merge_states(parts))
    assert_bit_equal(union_state(old), union_state(new))

    train_step(old, 10)
    train_step(new, 10)
    assert_bit_equal(union_state(old), union_state(new))


def test_digests_match_the_published_stage_digests():
    [stage] = build_split(resnet_job(), [(0, 5)])
    train_step([stage], 0)
    state = capture_state(stage)
    published = tensor_digests({**stage.parameters_by_name(), **stage.buffers_by_name()})
    assert published
    for name, digest in published.items():
        assert state.digests[name] == digest


def _corrupt(kind, state):
    tensors, digests = dict(state.tensors), dict(state.digests)
    name = "1.conv1.weight"
    if kind == "digest":
        digests[name] = "0" * 16
    elif kind == "bytes":
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += 1
    elif kind == "shape":
        tensors[name] = tensors[name].reshape(-1)
        digests[name] = tensor_digest(tensors[name])
    elif kind == "dtype":
        tensors[name] = tensors[name].double()
        digests[name] = tensor_digest(tensors[name])
    elif kind == "unknown":
        tensors["9.weight"], digests["9.weight"] = torch.zeros(1), tensor_digest(torch.zeros(1))
    elif kind == "missing":
        del tensors[name], digests[name]
    elif kind == "partial_optim":
        del tensors[f"optim/{name}/exp_avg"], digests[f"optim/{name}/exp_avg"]
    elif kind == "nan":
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = float("nan")
        digests[name] = tensor_digest(tensors[name])
    return type(state)(tensors=tensors, digests=digests, meta=state.meta)


@pytest.mark.parametrize(
    "kind", ["digest", "bytes", "shape", "dtype", "unknown", "missing", "partial_optim", "nan"]
)
def test_a_bad_state_is_refused_and_changes_nothing(kind):
    job = resnet_job()
    [source] = build_split(job, [(0, 5)])
    train_step([source], 0)
    bad = _corrupt(kind, capture_state(source))
    [target] = build_split(job, [(0, 5)])
    train_step([target], 7)
    before, steps, version = union_state([target]), target.num_steps, target.weight_version
    with pytest.raises(StateMismatch):
        restore_state(target, bad)
    assert_bit_equal(before, union_state([target]))
    assert (target.num_steps, target.weight_version) == (steps, version)


def test_merge_refuses_sources_at_different_steps_and_conflicting_tensors():
    job = resnet_job()
    a, b = build_split(job, [(0, 2), (2, 5)])
    train_step([a, b], 0)
    sa, sb = capture_state(a), capture_state(b)
    train_step([a, b], 1)
    with pytest.raises(StateMismatch, match="different steps"):
        merge_states([capture_state(a), sb])
    with pytest.raises(StateMismatch, match="disagree"):
        merge_states([sa, capture_state(a)])


def test_partial_restore_of_parameters_only_keeps_the_counters():
    job = resnet_job()
    [source] = build_split(job, [(0, 5)])
    train_step([source], 0)
    [target] = build_split(job, [(0, 5)])
    params = capture_state(source, list(source.parameters_by_name()))
    tensors_only = type(params)(tensors=params.tensors, digests=params.digests, meta=None)
    with pytest.raises(StateMismatch, match=r"lacks|counters"):
        restore_state(target, tensors_only)
    restore_state(target, tensors_only, complete=False)
    assert target.num_steps == 0
    for name, p in target.parameters_by_name().items():
        assert torch.equal(p, source.parameters_by_name()[name])


def test_expected_entries_name_every_slot_and_sources_cover_ranges():
    [stage] = build_split(resnet_job(), [(3, 5)])
    entries = expected_entries(stage)
    assert "optim/4.2.weight/exp_avg" in entries
    assert entries["optim/4.2.weight/step"].shape == ()
    assert sources_for_range(3, 7, [("x", 0, 5), ("y", 5, 9)]) == [("x", 3, 5), ("y", 5, 7)]
    with pytest.raises(ValueError, match="no owner"):
        sources_for_range(3, 7, [("x", 0, 4), ("y", 5, 9)])


def test_a_finished_stage_hands_its_tensors_over_without_a_second_copy():
    job = resnet_job(ADAM)
    [stage] = build_split(job, [(0, 5)])
    train_step([stage], 0)
    copied, taken = capture_state(stage), capture_state(stage, copy=False)
    assert copied.tensors.keys() == taken.tensors.keys()
    assert copied.digests == taken.digests
    live = stage.parameters_by_name()
    name = next(iter(live))
    assert taken.tensors[name].data_ptr() == live[name].data_ptr()  # the same storage, not a copy
    assert copied.tensors[name].data_ptr() != live[name].data_ptr()
