"""`RunClient.plan` (client-side placement) plans with the link matrix the peers' records report."""

from __future__ import annotations

from typing import Any

from ravnest_p2p.discovery.records import SCHEMA_VERSION, PeerRecord
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.placement import capacities_from_records, links_from_records, plan_assignment

A = "QmVRjtfVd4D7oN4Ca6PPG8GoxuGoYwp47sEk9yYknEHqAj"
B = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
C = "QmVRjtfVd4D7oN4Ca6PPG8GoxuGoYwp47sEk9yYknEHqAk"


def _record(peer_id: str, links: list[dict[str, Any]]) -> PeerRecord:
    return PeerRecord.model_validate(
        {
            "schema_version": SCHEMA_VERSION,
            "peer_id": peer_id,
            "flops": 5e10,
            "free_memory_bytes": 8 * 2**30,
            "upload_mbps": 100.0,
            "download_mbps": 100.0,
            "state": "ready",
            "updated_at": 1.7e9,
            "links": links,
        }
    )


def _slow(peer_id: str) -> dict[str, Any]:
    return {"peer_id": peer_id, "up_mbps": 0.5, "down_mbps": 0.5, "rtt_ms": 300.0}


def test_the_matrix_comes_from_the_records_links() -> None:
    records = [_record(A, [_slow(B)]), _record(B, []), _record(C, [])]
    matrix = links_from_records(records, capacities_from_records(records))
    assert matrix.rate(A, B) == 0.5e6 / 8  # measured by A
    assert matrix.rate(B, A) == 0.5e6 / 8  # A's download from B is B -> A
    assert matrix.rate(A, C) == 100e6 / 8  # unmeasured: min(up, down)


def test_a_slow_pair_is_never_made_pipeline_neighbours() -> None:
    records = [_record(A, [_slow(C)]), _record(C, [_slow(A)]), _record(B, [])]
    job = JobSpec(job_id="links-1", model="digits_cnn", dataset="digits", batch_size=32, max_steps=10)
    (blind,) = plan_assignment(records, job, min_stages=3, use_links=False)
    assert [stage.peer_id for stage in blind][1] == C  # without the matrix: A -> C -> B
    (cluster,) = plan_assignment(records, job, min_stages=3)
    order = [stage.peer_id for stage in cluster]
    assert order[1] == B, order  # A and C, whose link is 200x slower, sit at the two ends
