"""`planning.mode_layout`: which peers are the workers (and owners) of a sync_backup or ist job."""

from __future__ import annotations

import pytest

from ravnest_p2p.planning import InfeasiblePlan, PeerCapacity
from ravnest_p2p.planning.mode_layout import WorkerDoesNotFit, ist_layout, rank_workers, sync_backup_layout

GIB = 2**30


def peer(peer_id: str, *, tflops: float = 1.0, memory_gib: float = 4.0, mbps: float = 100.0) -> PeerCapacity:
    rate = mbps * 1e6 / 8
    return PeerCapacity(
        peer_id=peer_id,
        flops_per_s=tflops * 1e12,
        memory_bytes=int(memory_gib * GIB),
        upload_bytes_per_s=rate,
        download_bytes_per_s=rate,
    )


def test_sync_backup_takes_the_fastest_and_the_n_fastest_own() -> None:
    peers = [
        peer("a", tflops=1),
        peer("b", tflops=4),
        peer("c", tflops=2),
        peer("d", tflops=3),
        peer("e", tflops=0.5),
    ]
    layout = sync_backup_layout(peers, num_required=2, num_backup=1, need_bytes=GIB)
    assert layout.workers == ("b", "d", "c")  # fastest first: the slowest chosen one is the backup
    assert layout.owners == ("b", "d")
    assert sync_backup_layout(peers, num_required=3, num_backup=0, need_bytes=GIB).owners is None


def test_peers_too_small_for_a_worker_are_left_out_and_the_order_is_deterministic() -> None:
    peers = [peer("a", tflops=9, memory_gib=0.5), peer("c"), peer("b"), peer("d", tflops=2)]
    layout = ist_layout(peers, num_workers=3, need_bytes=GIB)
    assert layout.workers == ("d", "b", "c")  # "a" is fastest but cannot hold a worker; ties by peer id
    assert ist_layout(list(reversed(peers)), num_workers=3, need_bytes=GIB) == layout


def test_a_slow_link_ranks_a_peer_behind_when_the_step_exchanges_much() -> None:
    peers = [peer("fast-cpu-slow-link", tflops=4, mbps=1), peer("ok", tflops=1, mbps=100)]
    # 1 GFLOP and 10 MB per step: 0.25 ms + 80 s against 1 ms + 0.8 s
    ranked = rank_workers(peers, need_bytes=0, compute_flops=1e9, exchange_bytes=1e7)
    assert [p.peer_id for p in ranked] == ["ok", "fast-cpu-slow-link"]
    assert [p.peer_id for p in rank_workers(peers, need_bytes=0)] == ["fast-cpu-slow-link", "ok"]


def test_a_model_too_big_for_every_peer_gets_the_clear_error() -> None:
    peers = [peer(p, memory_gib=2) for p in "abcd"]
    with pytest.raises(WorkerDoesNotFit, match=r"the model does not fit on one peer: .* use mode pipeline"):
        sync_backup_layout(peers, num_required=2, num_backup=1, need_bytes=3 * GIB)
    with pytest.raises(WorkerDoesNotFit, match="the model does not fit on one peer"):
        ist_layout(peers, num_workers=2, need_bytes=3 * GIB)


def test_too_few_peers_that_fit_is_infeasible_with_the_count() -> None:
    peers = [peer("a", memory_gib=8), peer("b", memory_gib=8), peer("c", memory_gib=1)]
    with pytest.raises(InfeasiblePlan, match=r"needs 3 workers .* only 2 of the 3 peers") as caught:
        sync_backup_layout(peers, num_required=2, num_backup=1, need_bytes=4 * GIB)
    assert not isinstance(caught.value, WorkerDoesNotFit)
