"""CPU cost of one swap proposal (`dtfm_anneal.SwapState.propose`) on the hard placement cases.

The annealing search's speed is its proposals per CPU second. This times a fixed, seeded sequence of
proposals on each hard case of `placement_cases` (every tenth one applied, so the state and the path
warm start move) and prints one JSON line per case. To compare two versions of the code, run it
against each source tree at once (the same load hits both), e.g.::

    git archive <old commit> src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src:. nice -n 5 python -m benchmarks.bench_placement_swaps old &
    PYTHONPATH=src:. nice -n 5 python -m benchmarks.bench_placement_swaps new
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from benchmarks.placement_cases import default_cases
from ravnest_p2p.planning.dtfm import random_placement
from ravnest_p2p.planning.dtfm_anneal import SwapState


def main(label: str, draws: int = 400) -> None:
    for case in default_cases():
        model = case.model()
        rng = np.random.default_rng(7)
        state = SwapState(model, random_placement(model.workload, rng), soft=False)
        n = model.num_devices
        picks = [(int(rng.integers(n)), int(rng.integers(n))) for _ in range(draws)]
        started = time.process_time()
        done = 0
        for u, v in picks:
            if state.group_of[u] == state.group_of[v]:
                continue
            proposal = state.propose(u, v)
            if done % 10 == 0:
                state.apply(proposal)
            done += 1
        spent = time.process_time() - started
        row = {"code": label, "case": case.name, "proposals": done, "cpu_s": round(spent, 3),
               "ms_per_proposal": round(spent / done * 1e3, 3)}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "current")
