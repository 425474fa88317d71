"""The churn soak's log reading: phase times after an event, failures that blame a peer that stayed."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.soak_logs import phase_times, spurious_failures

LOG = """\
12:00:01 INFO [ravnest_p2p.membership.agreement] a member of the active plan is excluded: opening epoch 5
12:00:04 INFO [ravnest_p2p.membership.agreement] plan 0123abcd active for epoch 5: 2 clusters, 0 spares
12:00:06 INFO [ravnest_p2p.training.supervisor] job soak: stage state from {'0-3': 'QmA'}
12:00:07 INFO [ravnest_p2p.training.runner] resumed at micro-batch 640: held-out loss 0.06 accuracy 0.98
12:00:30 ERROR [service] stage 1 failed: pipeline neighbour QmB lost: no answer for 7.0s
12:00:31 ERROR [service] stage 2 failed: pipeline neighbour QmGone lost: forward failed 3 times
"""


def test_phases_follow_the_event_and_failures_blaming_a_peer_that_stayed_are_spurious(tmp_path: Path):
    (tmp_path / "peer0.log").write_text(LOG)
    event_t = time.mktime(time.strptime("2026-01-02 12:00:00", "%Y-%m-%d %H:%M:%S"))
    [row] = phase_times(tmp_path, [{"t": event_t, "action": "kill", "peer": 3}])
    assert row == {
        "action": "kill",
        "peer": 3,
        "detected_s": 1,
        "plan_active_s": 4,
        "state_arrived_s": 6,
        "resumed_s": 7,
    }
    assert spurious_failures(tmp_path, ["QmGone"]) == 1
