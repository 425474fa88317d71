"""Over real p2p daemons: a cluster the new plan did not change keeps training while the other re-forms.

See `_in_place_scenario`: plan 1 has clusters A and B of two stages; plan 2 adds a peer to B (which
re-forms, with hand-over) and keeps A unchanged. A's runner must never restart and its optimizer steps
must not stop for longer than a bound scaled for a busy host; B resumes with its state, not from the
initial loss; both clusters finish the job above the accuracy bar.
"""

from __future__ import annotations

import pytest

from tests.integration.training._in_place_scenario import run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

INITIAL_LOSS = 2.30  # ln(10): ten digit classes, an untrained model


async def test_an_unchanged_cluster_keeps_training_while_the_other_re_forms():
    outcome = await run_scenario(in_place=True)
    print(outcome.summary())
    assert outcome.a_runners == 1  # the same runner object before and after the re-plan
    assert outcome.a_moved_in_place == 1
    # A keeps stepping: all five stages share one compute thread here, so B's hand-over and resumption
    # evaluation hold A for a while (about as long as A's own restart took before: see
    # docs/elastic.md); the bound only catches A stalling for good, scaled for a busy host
    assert outcome.stall_s < max(6.0, 30 * outcome.median_step_s), outcome.summary()
    assert outcome.b_resumed_loss is not None
    assert outcome.b_resumed_loss < 0.6 * INITIAL_LOSS  # B resumed with its state
    # 160 micro-batches of 32 per cluster (one undisturbed process: 0.944 after 65, 0.964 after 130);
    # measured here 0.928 - 0.981 over five runs
    assert outcome.accuracy.get("A", 0.0) >= 0.90, outcome.summary()
    assert outcome.accuracy.get("B", 0.0) >= 0.90, outcome.summary()
