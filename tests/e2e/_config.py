"""Peer settings the e2e tests share: fast membership, so a dead peer is noticed and re-planned in seconds
(the text lives in the package, `ravnest_p2p.lab.peer_presets`, shared with the churn soak)."""

from ravnest_p2p.lab.peer_presets import FAST_MEMBERSHIP_PEER_CONFIG

__all__ = ["FAST_MEMBERSHIP_PEER_CONFIG"]
