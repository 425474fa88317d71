"""The per-stage memory model: its parts, the measured activations, a peer's refusal and the planner's
explanation when the peers cannot hold the model (issue 17, parts 2 and 3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ravnest_p2p.discovery.records import PeerRecord
from ravnest_p2p.models import profile_layers
from ravnest_p2p.planning import InfeasiblePlan, JobParams, PeerCapacity
from ravnest_p2p.planning.memory import layer_memory_bytes, memory_shortfall, stage_memory
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.memory_fit import StageDoesNotFit, check_stage_fits
from ravnest_p2p.training.placement import job_params, layer_profiles, plan_assignment, stage_profiles
from ravnest_p2p.types import LayerProfile, PeerState

LM = {"vocab_size": 31, "block_size": 16, "num_layers": 4, "embed_dim": 32, "num_heads": 4}
JOB = JobSpec(model="causal_lm", model_params=LM, dataset="char_corpus", batch_size=2, max_in_flight=3)


def test_the_parts_of_a_stage() -> None:
    layer = LayerProfile(
        name="0:X",
        flops_per_sample=1.0,
        param_bytes=1000,
        trainable_bytes=800,
        optimizer_state_bytes=1600,
        activation_bytes_per_sample=10,
        saved_bytes_per_sample=30,
    )
    job = JobParams(micro_batch_size=4, max_in_flight=3, memory_headroom=1.0)
    memory = stage_memory([layer, layer], job)
    assert (memory.param_bytes, memory.stash_bytes, memory.grad_bytes) == (2000, 2 * 3 * 800, 1600)
    assert (memory.optimizer_bytes, memory.activation_bytes) == (3200, 2 * 3 * 4 * 40)
    assert memory.total_bytes == 2000 + 4800 + 1600 + 3200 + 960
    assert (
        layer_memory_bytes(layer, job.model_copy(update={"memory_headroom": 1.5}))
        == 1.5 * memory.total_bytes / 2
    )


def test_the_profiler_measures_what_autograd_saves() -> None:
    # Linear saves its input; ReLU saves its output; the weight is a parameter, not counted
    layer = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    (profile,) = profile_layers([layer], torch.randn(5, 8), optimizer="adam")
    assert profile.saved_bytes_per_sample == (8 + 16) * 4
    assert profile.trainable_bytes == profile.param_bytes == (8 * 16 + 16) * 4
    assert profile.optimizer_state_bytes == 2 * profile.param_bytes


def test_a_stage_is_profiled_from_its_own_layers_as_in_the_whole_model() -> None:
    whole = layer_profiles(JOB)
    part = stage_profiles(JOB, 2, 5)
    for a, b in zip(whole[2:5], part, strict=True):
        assert (a.param_bytes, a.optimizer_state_bytes, a.activation_bytes_per_sample) == (
            b.param_bytes,
            b.optimizer_state_bytes,
            b.activation_bytes_per_sample,
        )
        assert a.saved_bytes_per_sample == b.saved_bytes_per_sample > 0


def test_a_peer_refuses_a_stage_that_does_not_fit() -> None:
    profiles = stage_profiles(JOB, 0, 3)
    params = job_params(JOB, num_layers=6).model_copy(update={"max_in_flight": 3})
    need = check_stage_fits(profiles, params, available_bytes=10**9, what="stage 0")
    with pytest.raises(
        StageDoesNotFit, match=r"stage 0 needs .* GiB \(params .*stash .*window 3\) but this peer"
    ):
        check_stage_fits(profiles, params, available_bytes=need - 1, what="stage 0")


def _record(peer: str, memory_bytes: int) -> PeerRecord:
    return PeerRecord.model_construct(
        peer_id=peer,
        flops=1e9,
        free_memory_bytes=memory_bytes,
        upload_mbps=100.0,
        download_mbps=100.0,
        state=PeerState.READY,
        client_mode=False,
        updated_at=1.0,
    )


def test_peers_too_small_for_the_model_get_a_planning_error_not_a_crash() -> None:
    layers = layer_profiles(JOB)
    params = job_params(JOB, num_layers=len(layers))
    need = sum(layer_memory_bytes(layer, params) for layer in layers)
    roomy = [_record(f"p{i}", need) for i in range(3)]
    assert plan_assignment(roomy, JOB)  # fits
    tight = [_record(f"p{i}", need // 4) for i in range(3)]
    with pytest.raises(InfeasiblePlan, match=r"needs .* GiB to train .* but the 3 peers offer .* together"):
        plan_assignment(tight, JOB)


def test_the_shortfall_names_the_largest_layer_when_the_total_would_do() -> None:
    job = JobParams(micro_batch_size=1, max_in_flight=1, memory_headroom=1.0)
    big = LayerProfile(
        name="0:Big",
        flops_per_sample=1,
        param_bytes=4000,
        optimizer_state_bytes=0,
        activation_bytes_per_sample=0,
    )
    peers = [
        PeerCapacity(
            peer_id=f"p{i}", flops_per_s=1, memory_bytes=3000, upload_bytes_per_s=1, download_bytes_per_s=1
        )
        for i in range(4)
    ]
    assert "largest layer" in (memory_shortfall(peers, [big], job) or "")
    assert memory_shortfall(peers[:1] * 1, [], job) is None


def test_profiling_keeps_no_layer_alive() -> None:
    # an op that saves its own output (GELU's input, softmax's output...) once held itself through the
    # saved-tensor hook: every profiled layer leaked
    import gc
    import weakref

    from ravnest_p2p.models import build_model

    layers = build_model("causal_lm", LM, seed=0)
    refs = [weakref.ref(p) for layer in layers for p in layer.parameters()]
    profile_layers(iter(layers), torch.randint(0, 31, (2, 16)))
    del layers
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_slow_peer_set_aside_comes_back_when_the_layers_need_its_memory() -> None:
    # 24 equal layers, 3 fit a peer: 8 peers are needed. One peer is 50x slower and would be a spare
    # (the other 7 hold the model's total memory), but 24 layers do not split over 7 peers of 3 each.
    from ravnest_p2p.planning import make_plan

    layer = LayerProfile(
        name="b",
        flops_per_sample=1e6,
        param_bytes=1000,
        optimizer_state_bytes=0,
        activation_bytes_per_sample=1,
    )
    job = JobParams(micro_batch_size=1, max_in_flight=1, memory_headroom=1.0)
    per_layer = layer_memory_bytes(layer, job)
    peers = [
        PeerCapacity(
            peer_id=f"p{i}",
            flops_per_s=1e7 if i == 3 else 5e8,
            memory_bytes=int(3.5 * per_layer),
            upload_bytes_per_s=1e7,
            download_bytes_per_s=1e7,
        )
        for i in range(8)
    ]
    plan = make_plan(peers, [layer] * 24, job, epoch=0)
    assert len(plan.clusters) == 1
    assert len(plan.clusters[0].stages) == 8
    assert plan.spare_peer_ids == ()
