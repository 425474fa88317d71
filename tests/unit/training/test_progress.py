"""JobProgress: merged across writers, trusted by signer, and the rule that keeps dead jobs dead."""

from __future__ import annotations

from ravnest_p2p.training.progress import (
    PROGRESS_KEY,
    JobProgress,
    ProgressView,
    may_start,
    merge_progress,
    publish_progress,
    read_progress,
)

from ._fakes import FakeDHT


def rec(peer: str, **kw) -> JobProgress:
    base = {"job_id": "j", "peer_id": peer, "cluster": 0, "updated_at": 1.0}
    return JobProgress(**{**base, **kw})


def test_merge_takes_the_newest_epoch_and_the_furthest_position():
    view = merge_progress(
        {
            "a": rec("a", epoch=1, cluster=0, micro_batches=40, optimizer_steps=40, train_wall_s=10.0),
            "b": rec("b", epoch=2, cluster=0, micro_batches=44, epoch_start=40, optimizer_steps=44),
            "c": rec("c", epoch=2, cluster=1, micro_batches=40, epoch_start=40),
        },
        job_id="j",
        owner_peer_id="owner",
    )
    assert view is not None
    assert (view.epoch, view.micro_batches, view.optimizer_steps, view.train_wall_s) == (2, 44, 44, 10.0)
    assert view.started_epoch
    assert view.positions == {(1, 0): 40, (2, 0): 44, (2, 1): 40}
    assert not view.finished


def test_records_of_others_forged_writers_and_untrusted_stops_are_ignored():
    records = {
        "a": rec("a", job_id="other", done=True),  # another job
        "b": rec("mallory", done=True),  # names a writer that did not sign it
        "c": JobProgress(job_id="j", peer_id="c", stopped=True, ended=True),  # a stop, not by the owner
    }
    assert merge_progress(records, job_id="j", owner_peer_id="owner") is None
    owner_stop = {"owner": JobProgress(job_id="j", peer_id="owner", stopped=True, ended=True)}
    view = merge_progress(owner_stop, job_id="j", owner_peer_id="owner")
    assert view is not None
    assert view.stopped
    assert view.finished
    assert view.reason == "stopped by its owner"


def test_may_start_refuses_ended_superseded_and_already_moving_plans():
    assert may_start(None, epoch=0, holds_state=False) == (True, "")
    ended = ProgressView(job_id="j", ended=True, reason="stage 1 failed")
    assert may_start(ended, epoch=5, holds_state=True)[0] is False
    assert may_start(ProgressView(job_id="j", done=True), epoch=5, holds_state=True)[0] is False
    newer = ProgressView(job_id="j", epoch=3)
    ok, why = may_start(newer, epoch=2, holds_state=False)
    assert not ok
    assert "superseded" in why
    moving = ProgressView(job_id="j", epoch=2, started_epoch=True)
    ok, why = may_start(moving, epoch=2, holds_state=False)
    assert not ok
    assert "without this peer's state" in why
    assert may_start(moving, epoch=2, holds_state=True)[0]
    assert may_start(moving, epoch=3, holds_state=False)[0]  # the next plan moves the state to it
    assert may_start(ProgressView(job_id="j", epoch=2), epoch=2, holds_state=False)[0]  # not started yet


async def test_publish_and_read_round_trip_through_a_signed_store():
    dht = FakeDHT("a")
    assert await publish_progress(dht, rec("a", epoch=1, micro_batches=5, epoch_start=0))
    dht.store.setdefault(PROGRESS_KEY, {})["junk"] = ({"job_id": 5}, 1e18)  # malformed: ignored
    view = await read_progress(dht.as_signer("reader"), "j", owner_peer_id=None)
    assert view is not None
    assert view.micro_batches == 5
    assert view.started_epoch
