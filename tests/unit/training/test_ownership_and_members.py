"""Pure rules of the trust model: whose job runs (`pick_job`), whose metrics count (`member_metrics`)."""

from __future__ import annotations

from ravnest_p2p.discovery import PeerRecord, dht_time
from ravnest_p2p.membership import PlanRecord
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.metrics import StageMetrics, member_metrics, plan_members
from ravnest_p2p.training.runner import pick_job

OWNER, DELEGATE, STRANGER = "QmW" + "w" * 12, "QmD" + "d" * 12, "QmS" + "s" * 12
A, B, C = "QmA" + "a" * 12, "QmB" + "b" * 12, "QmC" + "c" * 12


def job(job_id: str) -> dict:
    return JobSpec(job_id=job_id).to_wire()


def owners(keys, expiry):
    return {OWNER: ({"schema_version": 1, "owner": OWNER, "keys": keys, "updated_at": dht_time()}, expiry)}


def test_open_run_takes_the_job_that_expires_last():
    now = dht_time()
    found = {OWNER: (job("mine"), now + 100), STRANGER: (job("theirs"), now + 1e6)}
    assert pick_job(found).job_id == "theirs"


def test_owned_run_ignores_strangers_whatever_their_ttl():
    now = dht_time()
    found = {OWNER: (job("mine"), now + 100), STRANGER: (job("theirs"), now + 1e6)}
    assert pick_job(found, run_owner=OWNER).job_id == "mine"
    assert pick_job({STRANGER: (job("theirs"), now + 1e6)}, run_owner=OWNER) is None


def test_a_delegate_counts_only_while_the_owner_says_so_and_no_longer():
    now = dht_time()
    found = {OWNER: (job("mine"), now + 100), DELEGATE: (job("deleg"), now + 1e5)}
    # listed until now + 50: the delegate's job expiry is capped there, below the owner's
    assert pick_job(found, run_owner=OWNER, owners=owners([DELEGATE], now + 50)).job_id == "mine"
    # listed for longer: its job (expiring later than the owner's) runs
    assert pick_job(found, run_owner=OWNER, owners=owners([DELEGATE], now + 500)).job_id == "deleg"
    # not listed, or listed by a record someone else signed
    assert pick_job(found, run_owner=OWNER).job_id == "mine"
    forged = {
        STRANGER: ({"schema_version": 1, "owner": STRANGER, "keys": [DELEGATE], "updated_at": 1}, now + 9)
    }
    assert pick_job(found, run_owner=OWNER, owners=forged).job_id == "mine"


def test_malformed_jobs_are_skipped():
    now = dht_time()
    found = {OWNER: ({"schema_version": 1, "job_id": "bad id!"}, now + 100)}
    assert pick_job(found, run_owner=OWNER) is None


def metrics(peer, cluster, stage, *, epoch=0, done=True) -> StageMetrics:
    return StageMetrics(
        job_id="j", peer_id=peer, cluster=cluster, stage=stage, num_stages=2, step=1, optimizer_steps=1,
        epoch=epoch, done=done, updated_at=dht_time(),
    )  # fmt: skip


def test_metrics_count_only_from_the_assignment():
    assignment = (
        (
            StagePlacement(peer_id=A, first_layer=0, end_layer=1),
            StagePlacement(peer_id=B, first_layer=1, end_layer=2),
        ),
    )
    ms = [metrics(A, 0, 0), metrics(B, 0, 1), metrics(STRANGER, 0, 0), metrics(C, 3, 0), metrics(B, 0, 0)]
    assert [(m.peer_id, m.stage) for m in member_metrics(ms, assignment=assignment)] == [(A, 0), (B, 1)]


def record(peer, epoch, cluster, stage) -> PeerRecord:
    return PeerRecord(
        peer_id=peer, flops=1, free_memory_bytes=1, epoch=epoch, cluster=cluster, stage=stage, updated_at=1
    )


def plan(epoch, digest) -> PlanRecord:
    return PlanRecord(epoch=epoch, digest=digest * 64, updated_at=1)


def test_plan_members_need_the_agreed_digest_and_an_unclaimed_position():
    records = {
        A: record(A, 2, 0, 0),
        B: record(B, 2, 0, 1),
        C: record(C, 2, 0, 1),
        STRANGER: record(STRANGER, 2, 1, 0),
    }
    plans = {A: plan(2, "a"), B: plan(2, "a"), C: plan(2, "b"), STRANGER: plan(2, "a")}
    # C disagrees on the digest; the stranger announces an agreed digest and a free position
    assert plan_members(records, plans) == {2: {A: (0, 0), B: (0, 1), STRANGER: (1, 0)}}
    # two agreeing peers claiming one position: neither counts
    plans[C] = plan(2, "a")
    assert plan_members(records, plans) == {2: {A: (0, 0), STRANGER: (1, 0)}}
    # a plan record of another epoch does not count; a tie between digests means no members
    assert plan_members({A: record(A, 3, 0, 0)}, {A: plan(2, "a")}) == {}
    tie = {A: record(A, 4, 0, 0), B: record(B, 4, 0, 1)}
    assert plan_members(tie, {A: plan(4, "a"), B: plan(4, "b")}) == {}


def test_metrics_on_an_agreed_plan_count_from_members_at_their_position():
    members = {2: {A: (0, 0), B: (0, 1)}}
    ms = [
        metrics(A, 0, 0, epoch=2),
        metrics(B, 0, 0, epoch=2),
        metrics(A, 0, 0, epoch=1),
        metrics(STRANGER, 0, 0, epoch=2),
    ]
    assert member_metrics(ms, members=members) == [ms[0]]
    assert member_metrics(ms) == []
