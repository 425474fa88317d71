"""Pure pieces of the fault path and of replica agreement: digests, round participants, epochs, reruns."""

from __future__ import annotations

import torch

from ravnest_p2p.averaging import RingMetrics, RoundMetrics
from ravnest_p2p.client import newest_epoch
from ravnest_p2p.node import rerun_allowed
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.replicas import ReplicaAverager, tensor_digests


def test_digests_match_exactly_equal_tensors_only():
    a = {"0.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "0.bias": torch.zeros(2)}
    same = {name: t.clone() for name, t in a.items()}
    assert tensor_digests(a) == tensor_digests(same)
    nudged = {**same, "0.bias": torch.tensor([0.0, 1e-7])}
    assert tensor_digests(nudged)["0.bias"] != tensor_digests(a)["0.bias"]
    assert tensor_digests(nudged)["0.weight"] == tensor_digests(a)["0.weight"]


def test_digests_skip_integer_buffers_and_read_any_float_dtype():
    digests = tensor_digests(
        {
            "1.num_batches_tracked": torch.tensor(3),
            "1.running_mean": torch.ones(4, dtype=torch.bfloat16),
            "1.weight": torch.ones((), dtype=torch.float16),
        }
    )
    assert set(digests) == {"1.running_mean", "1.weight"}
    assert all(len(d) == 16 for d in digests.values())


def _ring(ring_id: str, members: tuple[str, ...]) -> RingMetrics:
    return RingMetrics(
        ring_id=ring_id,
        numel=10,
        participants=members,
        attempts=1,
        time_s=0.1,
        bytes_sent=0,
        bytes_received=0,
    )


def test_last_round_participants_is_the_fewest_over_the_stage_rings():
    replicas = ReplicaAverager.__new__(ReplicaAverager)  # only the round history matters here
    replicas.rounds = []
    assert replicas.last_round_participants is None
    replicas.rounds.append(
        RoundMetrics(round=1, time_s=0.2, bytes_sent=0, bytes_received=0, rings=[_ring("a", ("p", "q"))])
    )
    assert replicas.last_round_participants == 2
    replicas.rounds.append(
        RoundMetrics(
            round=2,
            time_s=3.0,
            bytes_sent=0,
            bytes_received=0,
            rings=[_ring("a", ("p", "q")), _ring("b", ("p",))],  # q died: ring b finished without it
        )
    )
    assert replicas.last_round_participants == 1


def _metrics(peer: str, epoch: int, **fields: object) -> StageMetrics:
    return StageMetrics.model_validate(
        {"job_id": "j", "peer_id": peer, "cluster": 0, "stage": 0, "num_stages": 2, "step": 1}
        | {"optimizer_steps": 1, "updated_at": 1.0, "epoch": epoch, **fields}
    )


def test_newest_epoch_drops_what_an_old_plan_left_behind():
    stale = [_metrics("dead", 3), _metrics("survivor-failed", 3, failed="forward failed 3 times")]
    current = [_metrics("a", 4), _metrics("b", 4)]
    assert newest_epoch([*stale, *current]) == current
    assert newest_epoch([]) == []


def test_metrics_without_an_epoch_field_read_as_epoch_zero():
    wire = _metrics("a", 0).model_dump(mode="json")
    del wire["epoch"]
    assert StageMetrics.model_validate(wire).epoch == 0


def test_a_failed_job_runs_again_only_on_a_newer_plan():
    assert rerun_allowed(None, 1)
    assert not rerun_allowed(5, 5)
    assert not rerun_allowed(5, 4)
    assert rerun_allowed(5, 6)
