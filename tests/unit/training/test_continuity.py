"""Which clusters keep training through a re-plan (`continuity`), and what the progress says meanwhile."""

from __future__ import annotations

from ravnest_p2p.training.continuity import continues_in_place, stays_in_place, unchanged_cluster
from ravnest_p2p.training.job import StagePlacement
from ravnest_p2p.training.progress import JobProgress, may_start, merge_progress
from ravnest_p2p.training.role import role_for

from ._fakes import make_plan
from .test_supervisor import JOB

A = [("a", 0, 1), ("b", 1, 3)]
B = [("c", 0, 1), ("d", 1, 3)]


def role(plan, peer="b"):
    return role_for(JOB, plan, peer, num_train_samples=204)


def test_a_cluster_with_the_same_peers_and_layers_is_unchanged_wherever_it_sits_in_the_new_plan():
    old = role(make_plan(1, A, B))
    # the other cluster lost a peer: ours is now cluster 1 of 2
    plan = make_plan(2, [("c", 0, 3)], A)
    new = role(plan)
    assert unchanged_cluster(old, new.assignment) == 1
    assert stays_in_place(old, plan, "b")
    assert continues_in_place(old, new)
    assert (new.cluster_index, new.stage_index) == (1, 1)
    # a third cluster joined: the shard and the last step change, the pipeline does not
    plan3 = make_plan(3, A, B, [("e", 0, 3)])
    assert continues_in_place(old, role(plan3))
    assert role(plan3).final_step < old.final_step
    # the only cluster left: no replicas any more, still unchanged
    assert continues_in_place(old, role(make_plan(4, A)))


def test_any_change_of_peers_order_or_boundaries_takes_the_hand_over_path():
    old = role(make_plan(1, A, B))
    for changed in (
        [("a", 0, 2), ("b", 2, 3)],  # a boundary moved
        [("b", 0, 1), ("a", 1, 3)],  # the order changed
        [("a", 0, 1), ("b", 1, 2), ("c", 2, 3)],  # a peer joined the cluster
    ):
        plan = make_plan(2, changed, [("d", 0, 3)])
        assert unchanged_cluster(old, role(plan).assignment) is None
        assert not stays_in_place(old, plan, "b")
        assert not continues_in_place(old, role(plan))
    assert not continues_in_place(old, role(make_plan(2, [("a", 0, 3)], [("c", 0, 3)]), "a"))
    # b is not in the new plan at all
    assert not continues_in_place(old, role(make_plan(2, [("a", 0, 3)])))
    assert not stays_in_place(old, make_plan(2, [("a", 0, 3)]), "b")


def test_only_a_newer_agreed_plan_moves_a_stage_in_place():
    old = role(make_plan(3, A, B))
    assert not continues_in_place(old, role(make_plan(3, A, B)))  # the same epoch: a retry
    assert not continues_in_place(old, role(make_plan(2, A, B)))  # an older plan
    assert not stays_in_place(old, make_plan(2, A, B), "b")
    assert not stays_in_place(old, make_plan(4, A, B), "a")  # another peer's question
    assigned = JOB.model_copy(
        update={
            "assignment": tuple(
                tuple(StagePlacement(peer_id=p, first_layer=f, end_layer=e) for p, f, e in c) for c in (A, B)
            )
        }
    )
    on_assignment = role_for(assigned, None, "b", num_train_samples=204)
    assert not continues_in_place(on_assignment, role(make_plan(4, A, B)))


def test_a_cluster_kept_running_does_not_lock_the_re_formed_clusters_out_of_the_new_epoch():
    """The unchanged cluster starts epoch 2 at once; a re-formed cluster's stages may still start it."""
    records = {
        "a": JobProgress(
            job_id="j", peer_id="a", epoch=2, cluster=1, num_clusters=2, epoch_start=40, micro_batches=45
        ),
        "c": JobProgress(
            job_id="j", peer_id="c", epoch=1, cluster=1, num_clusters=2, epoch_start=0, micro_batches=38
        ),
    }
    view = merge_progress(records, job_id="j", owner_peer_id=None)
    assert view is not None
    assert view.started_epoch
    assert view.started == {(2, 1), (1, 1)}
    assert not view.all_started  # cluster 0 of epoch 2 has not trained yet (a leaver keeps serving)
    assert may_start(view, epoch=2, holds_state=False, cluster=0)[0]
    ok, why = may_start(view, epoch=2, holds_state=False, cluster=1)
    assert not ok
    assert "already trains" in why
    assert not may_start(view, epoch=2, holds_state=False)[0]  # without a cluster: any pipeline counts
    records["c"] = JobProgress(
        job_id="j", peer_id="c", epoch=2, cluster=0, num_clusters=2, epoch_start=40, micro_batches=41
    )
    assert merge_progress(records, job_id="j", owner_peer_id=None).all_started
