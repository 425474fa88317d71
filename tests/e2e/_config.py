"""Peer settings the e2e tests share: fast membership, so a dead peer is noticed and re-planned in seconds
(the text lives in the package, `ravnest_p2p.lab.peer_presets`, shared with the churn soak).

`PINNED_COMPUTE` is appended by tests that need a given plan shape (two clusters of two stages): peers
that measured their compute while the host was busy (5.5 vs 0.1 GFLOP/s, seen) were planned as one
cluster and two spares. Pinned, the figure does not depend on the host's load (`EmulationConfig`).
"""

from ravnest_p2p.lab.peer_presets import FAST_MEMBERSHIP_PEER_CONFIG

__all__ = ["FAST_MEMBERSHIP_PEER_CONFIG", "PINNED_COMPUTE"]

PINNED_COMPUTE = "\n[emulate]\nflops_per_s = 5e9\n"
