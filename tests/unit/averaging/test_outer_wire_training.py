"""With the wire in the loop (int8/int4 re-quantised per hop), training matches uncompressed within 1 %.

Four clusters in one process, every outer sync an `OuterAverager` round over the in-memory rings
(`benchmarks/outer_wire.py`), on scikit-learn's digits with a small MLP. Marked slow.
"""

import pytest
import torch
from benchmarks.outer_sim import make_problem
from benchmarks.outer_wire import train_over_rings

from ravnest_p2p.averaging import DeltaCompression, OuterOptimizerConfig

H = 10
STEPS = 300

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def problem():
    torch.set_num_threads(1)
    return make_problem("digits", hidden=32, batch_size=32)


@pytest.fixture(scope="module")
def uncompressed(problem):
    return train_over_rings(problem, OuterOptimizerConfig(), period=H, num_steps=STEPS, eval_every=STEPS)


@pytest.mark.parametrize("codec", [DeltaCompression.INT8, DeltaCompression.INT4])
def test_quantised_delta_on_the_wire_trains_within_one_percent(problem, uncompressed, codec):
    config = OuterOptimizerConfig(compression=codec)
    trace = train_over_rings(problem, config, period=H, num_steps=STEPS, eval_every=STEPS)
    assert trace.identical  # every replica applied the same decoded average after every sync
    assert uncompressed.identical
    assert trace.val_loss[-1] <= uncompressed.val_loss[-1] * 1.01
    assert sum(trace.sync_bytes) < 0.27 * sum(uncompressed.sync_bytes)
