"""role_for: one frozen role per (job, plan, peer); the pipeline window has one definition."""

from __future__ import annotations

import pytest

from ravnest_p2p.planning import PeerCapacity
from ravnest_p2p.planning.window import default_window, pipeline_window, planning_window
from ravnest_p2p.runtime import pipeline, service
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.placement import job_params
from ravnest_p2p.training.progress import ProgressView
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.stages import num_layers, steps_per_cluster

from ._fakes import make_plan

JOB = JobSpec(
    job_id="j",
    model="mlp",
    dataset="synthetic_classification",
    dataset_config={"num_samples": 256, "in_features": 16, "num_classes": 4},
    model_params={"in_features": 16, "hidden_features": [32, 32], "out_features": 4},
    batch_size=16,
    num_epochs=2,
)


def test_role_on_an_agreed_plan_holds_every_per_stage_fact():
    plan = make_plan(4, [("a", 0, 1), ("b", 1, 3)], [("c", 0, 2), ("d", 2, 3)])
    caps = {
        p: PeerCapacity(
            peer_id=p, flops_per_s=1e9, memory_bytes=1, upload_bytes_per_s=up, download_bytes_per_s=down
        )
        for p, up, down in [("a", 100.0, 50.0), ("b", 80.0, 30.0), ("c", 1.0, 1.0), ("d", 1.0, 1.0)]
    }
    progress = ProgressView(job_id="j", epoch=3, micro_batches=7, optimizer_steps=7, train_wall_s=12.5)
    role = role_for(JOB, plan, "b", progress=progress, num_train_samples=204, capacities=caps)
    assert role is not None
    assert (role.epoch, role.on_agreed_plan, role.cluster_index, role.num_clusters) == (4, True, 0, 2)
    assert (role.stage_index, role.first_layer, role.end_layer, role.num_stages) == (1, 1, 3, 2)
    assert role.prev_peer_id == "a"
    assert role.next_peer_id is None
    assert role.is_last
    assert not role.is_first
    assert role.peers == ["a", "b"]
    assert role.plan_peers == {"a", "b", "c", "d"}
    assert role.window == default_window(2) == 4
    assert role.link_in_bytes_per_s == 30.0  # min(a's upload, b's download)
    assert role.link_out_bytes_per_s is None
    assert role.final_step == steps_per_cluster(JOB, 204, 2)
    assert (role.data_start, role.optimizer_steps_start, role.train_wall_s_start) == (7, 7, 12.5)
    assert role.remaining_steps == role.final_step - 7
    # two clusters: the rings' shard map is part of the role, cut at every cluster's stage boundaries
    assert role.shard_map is not None
    assert role.shard_map.epoch == 4


def test_role_on_the_jobs_assignment_and_a_peer_not_in_it():
    job = JOB.model_copy(
        update={
            "assignment": ((StagePlacement(peer_id="x", first_layer=0, end_layer=3),),),
            "max_in_flight": 2,
        }
    )
    role = role_for(job, None, "x", num_train_samples=204)
    assert role is not None
    assert (role.epoch, role.on_agreed_plan, role.window, role.shard_map) == (0, False, 2, None)
    assert role.is_first
    assert role.is_last
    assert role.data_start == 0
    assert role_for(job, None, "stranger", num_train_samples=204) is None
    assert role_for(JOB, make_plan(1, [("a", 0, 3)]), "spare", num_train_samples=204) is None


def test_until_stopped_jobs_have_no_final_step_unless_capped():
    forever = JOB.model_copy(update={"until_stopped": True})
    plan = make_plan(1, [("a", 0, 3)])
    role = role_for(forever, plan, "a", num_train_samples=204)
    assert role is not None
    assert role.final_step is None
    assert role.remaining_steps is None
    capped = role_for(forever.model_copy(update={"max_steps": 500}), plan, "a", num_train_samples=204)
    assert capped is not None
    assert capped.final_step == 500


def test_same_stage_compares_job_plan_cluster_and_layers():
    a = role_for(JOB, make_plan(1, [("a", 0, 1), ("b", 1, 3)]), "a", num_train_samples=204)
    again = role_for(JOB, make_plan(1, [("a", 0, 1), ("b", 1, 3)]), "a", num_train_samples=204)
    moved = role_for(JOB, make_plan(2, [("a", 0, 1), ("b", 1, 3)]), "a", num_train_samples=204)
    assert a is not None
    assert a.same_stage(again)
    assert not a.same_stage(moved)
    assert not a.same_stage(None)


# ----- the one window ---------------------------------------------------------------------------------
def test_runtime_and_planner_use_the_planning_window():
    assert pipeline.default_window is default_window
    assert service.default_window is default_window
    assert [default_window(s) for s in (1, 2, 3, 4)] == [1, 4, 7, 10]
    assert pipeline_window(None, 3) == 7
    assert pipeline_window(5, 3) == 5
    with pytest.raises(ValueError, match="at least one stage"):
        default_window(0)


@pytest.mark.parametrize("max_in_flight", [None, 2, 9])
def test_the_planner_never_budgets_less_than_any_cluster_of_the_job_runs(max_in_flight):
    job = JOB.model_copy(update={"max_in_flight": max_in_flight})
    layers = num_layers(job)
    budget = job_params(job).max_in_flight
    assert budget == planning_window(max_in_flight, layers)
    for num_stages in range(1, layers + 1):  # a cluster never has more stages than layers
        cluster = [(f"p{i}", i, i + 1) for i in range(num_stages - 1)] + [
            (f"p{num_stages - 1}", num_stages - 1, layers)
        ]
        role = role_for(job, make_plan(1, cluster), "p0", num_train_samples=204)
        assert role is not None
        assert role.window == pipeline_window(max_in_flight, num_stages) <= budget
