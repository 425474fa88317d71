"""Fake peer records and stage metrics for the dashboard's unit tests."""

from __future__ import annotations

from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.training.metrics import StageMetrics


def pid(i: int) -> str:
    return "QmP" + "".join("abcdefghij"[int(d)] for d in str(i)) + "p" * 20


def peer(i: int, *, cluster: int | None = None, stage: int | None = None, device: str = "cpu") -> PeerRecord:
    return PeerRecord(
        peer_id=pid(i),
        flops=2.5e9,
        free_memory_bytes=3 * 2**30,
        upload_mbps=100.0,
        download_mbps=200.0,
        rtt_ms=1.25,
        state="ready",
        epoch=3,
        cluster=cluster,
        stage=stage,
        device=device,
        updated_at=990.0,
    )


def stage(cluster: int, stage_index: int, *, step: int, loss: float | None, rounds: int) -> StageMetrics:
    return StageMetrics(
        job_id="j1",
        peer_id=pid(cluster * 2 + stage_index),
        epoch=3,
        cluster=cluster,
        stage=stage_index,
        num_stages=2,
        step=step,
        optimizer_steps=step // 4,
        loss=loss,
        samples_per_s=640.0,
        averaging_rounds=rounds,
        last_round_s=0.4 + cluster,
        last_round=rounds,
        last_round_participants=2,
        averaging_bytes_sent=5_000_000,
        eval_accuracy=0.9 if stage_index == 0 else None,
        updated_at=995.0,
    )
