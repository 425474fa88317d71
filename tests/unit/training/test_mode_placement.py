"""`training.mode_placement` and `RunClient.plan`: a sync_backup or ist job's assignment from records."""

from __future__ import annotations

import pytest

from ravnest_p2p.discovery.records import SCHEMA_VERSION, PeerRecord
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.models import count_layers
from ravnest_p2p.planning.mode_layout import WorkerDoesNotFit
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.mode_placement import check_worker_fits, place_mode_job, worker_need
from ravnest_p2p.training.mode_runner import UnsupportedModeRunner, start_mode_runner
from ravnest_p2p.training.modes import IstConfig, SyncBackupConfig
from ravnest_p2p.training.role import role_for

MLP = {"in_features": 64, "hidden_features": [64], "out_features": 10}
WIDE = {"in_features": 64, "hidden_features": [256, 256], "out_features": 10}


def pid(name: str) -> str:
    return f"Qmpeer{name}xxxx"  # a valid base58 peer id


def record(peer_id: str, *, gflops: float, memory_bytes: int) -> PeerRecord:
    return PeerRecord.model_validate(
        {
            "schema_version": SCHEMA_VERSION,
            "peer_id": pid(peer_id),
            "flops": gflops * 1e9,
            "free_memory_bytes": memory_bytes,
            "upload_mbps": 100.0,
            "download_mbps": 100.0,
            "state": "ready",
            "updated_at": 1.7e9,
        }
    )


def sync_job(**config: object) -> JobSpec:
    return JobSpec(
        job_id="sb",
        model="mlp",
        model_params=MLP,
        optimizer=OptimizerConfig(name="adam", lr=1e-3),
        mode="sync_backup",
        sync_backup=SyncBackupConfig.model_validate(config),
    )


def test_a_sync_backup_job_gets_one_single_stage_cluster_per_worker_and_owners() -> None:
    need, flops, exchange = worker_need(sync_job())
    assert min(need, flops, exchange) > 0
    records = [record(p, gflops=g, memory_bytes=2**30) for p, g in [("a", 1), ("b", 5), ("c", 3), ("d", 2)]]
    placed = place_mode_job(records, sync_job(num_required=2, num_backup=1))
    assert placed.assignment is not None
    assert [cluster[0].peer_id for cluster in placed.assignment] == [pid("b"), pid("c"), pid("d")]
    assert all(
        len(c) == 1 and (c[0].first_layer, c[0].end_layer) == (0, count_layers("mlp", MLP))
        for c in placed.assignment
    )
    assert placed.sync_backup.owners == (pid("b"), pid("c"))


def test_the_memory_need_rules_peers_out() -> None:
    need, _, _ = worker_need(sync_job())
    records = [record("big", gflops=1, memory_bytes=need), record("tiny", gflops=9, memory_bytes=need - 1)]
    placed = place_mode_job(records, sync_job(num_required=1))
    assert placed.assignment is not None
    assert placed.assignment[0][0].peer_id == pid("big")


def test_a_model_too_big_for_one_peer_gets_the_clear_error() -> None:
    need, _, _ = worker_need(sync_job())
    records = [record(p, gflops=1, memory_bytes=need // 2) for p in "abc"]
    # the pipeline planner could split it over the three peers; a sync_backup worker holds all of it
    with pytest.raises(WorkerDoesNotFit, match=r"the model does not fit on one peer.*use mode pipeline"):
        place_mode_job(records, sync_job(num_required=2))


def test_an_ist_worker_needs_its_replica_plus_a_share_of_the_wide_layers() -> None:
    def ist_job(n: int) -> JobSpec:
        return JobSpec(
            job_id="ist", model="wide_mlp", model_params=WIDE, mode="ist", ist=IstConfig(num_workers=n)
        )

    need_2, flops_2, bytes_2 = worker_need(ist_job(2))
    need_4, flops_4, bytes_4 = worker_need(ist_job(4))
    assert need_4 < need_2
    assert flops_4 < flops_2
    assert bytes_4 < bytes_2
    records = [record(p, gflops=1 + i, memory_bytes=2**30) for i, p in enumerate("wxyz")]
    placed = place_mode_job(records, ist_job(2))
    assert placed.assignment is not None
    assert [c[0].peer_id for c in placed.assignment] == [pid("z"), pid("y")]


async def test_a_peer_refuses_a_worker_it_cannot_hold_before_building_it() -> None:
    records = [record(p, gflops=1, memory_bytes=2**30) for p in "ab"]
    job = place_mode_job(records, sync_job(num_required=2))
    role = role_for(job, None, pid("a"), num_train_samples=100)
    assert role is not None
    need = check_worker_fits(job, 2**30)
    # the rpc is never touched: the worker is refused before it is built
    runner = start_mode_runner(None, None, job, role, None, memory_available_bytes=need - 1)  # type: ignore[arg-type]
    assert isinstance(runner, UnsupportedModeRunner)
    with pytest.raises(RavnestError, match=r"a sync_backup worker of job sb needs .* GiB"):
        await runner.run()
